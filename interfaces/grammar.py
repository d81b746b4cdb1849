"""Grammar backend: compiles a request's structured output and matches tokens against it.

The structured-output station. Core's grammar manager drives one backend for the engine:
it starts a request's compile at admission (the request waits, ``WAITING_FOR_GRAMMAR``,
holding no KV pages, until the compile is done), keeps one matcher per request for its whole
life (preemption included), fills the token bitmasks of the constrained rows each step, masks
their logits after every other logits stage, advances the matchers on the sampled tokens and
finishes a request whose grammar has ended.

Token bitmasks are int32 tensors ``[rows, ceil(vocab_size / 32)]`` on the host: bit ``j`` of
word ``i`` set means token ``32 * i + j`` is allowed (all bits set, -1, allows everything).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from brigade.interfaces.sampling import StructuredOutput

if TYPE_CHECKING:
    import torch

    from brigade.interfaces.model import Checkpoint

__all__ = ["GrammarBackend", "GrammarMatcher", "GrammarParams"]


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarParams:
    """What core hands a grammar backend at construction (plugin options come separately)."""

    vocab_size: int
    """Logits columns: bitmasks cover this many tokens."""
    eos_token_ids: tuple[int, ...]
    """The model's stop tokens: a grammar that has ended allows only these."""
    device: str
    """Where the logits live (the executor's device)."""
    checkpoint: Checkpoint | None = None
    """The opened model: ``checkpoint.tokenizer()`` gives the vocabulary's strings (None for
    an engine without a model, e.g. a unit test)."""
    mask_budget_s: float = 0.1
    """``[grammar] mask_budget_ms``: the longest one mask (or one accepted token) may take.
    Core enforces it while a request runs; a backend may refuse at compile time a grammar
    whose first mask already takes longer (API 2.6)."""


class GrammarMatcher(abc.ABC):
    """One request's position in its grammar.

    Core calls a matcher off the engine's step thread, one call at a time (never two at
    once on one matcher; different matchers may be called at the same time from different
    threads), and fails its request when a call takes longer than ``mask_budget_s``: the
    matcher is then never called again, though the call in flight is left to finish."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the tokens allowed next into row ``index`` of ``bitmask`` (see the module
        docstring for the layout)."""

    @abc.abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and no change) if the grammar forbids it."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True once the output is complete: the grammar accepted a stop token, or allows
        nothing but a stop token next. Core then finishes the request (reason ``stop``)."""


class GrammarBackend(abc.ABC):
    """Compiles structured-output specs and makes matchers for them.

    Constructed as ``factory(params: GrammarParams, options)``, once per engine. Compiling
    may be slow (a large JSON schema): :meth:`compile` returns at once with a future, and
    must be thread-safe (the server admits requests on its event loop while the engine
    steps). Cache compiled grammars by spec if compiling costs, and bound what a client can
    make it spend: the spec's size, the compile's time, the cache's memory.
    """

    @abc.abstractmethod
    def compile(self, spec: StructuredOutput) -> Future[Any]:
        """Start compiling ``spec``; the future's result is what :meth:`matcher` takes.

        The future fails with ``ValueError`` saying why when the spec is invalid, too
        large, too slow to compile or uses a feature the backend cannot enforce (never
        silently ignore a constraint): the request is refused with that message. Each call
        returns a future of its own: core cancels it when the request leaves before its
        grammar is ready, and the backend may then stop the compile if no other caller
        still waits for the same spec.
        """

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar ``compiled`` (a compile's result)."""

    def apply_bitmask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, indices: Sequence[int]
    ) -> None:
        """Set ``logits[i, t]`` to -inf for every token ``t`` that row ``i`` of ``bitmask``
        (already on the logits' device) forbids, for the rows ``indices``. The default unpacks
        the bits with torch; a backend may override it with a fused kernel."""
        import torch

        rows = torch.tensor(list(indices), dtype=torch.int64, device=logits.device)
        words = bitmask[rows]  # [R, W]
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [R, W * 32]
        vocab = logits.shape[-1]
        if allowed.shape[1] < vocab:  # logits wider than the grammar's vocabulary
            pad = allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])
            allowed = torch.cat([allowed, pad], dim=1)
        selected = logits[rows]
        selected.masked_fill_(~allowed[:, :vocab], float("-inf"))
        logits[rows] = selected

    def warm_up(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Do now the one-time work the first compile would otherwise do while requests run
        (loading libraries, building the vocabulary's tables): a server calls it once before
        it takes requests (API 2.6). Never raises for a missing resource: :meth:`compile`
        reports that."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Stop compile threads; called once when the engine shuts down."""
