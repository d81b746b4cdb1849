"""Proposer: draft tokens for speculative decoding (API 2.4).

A step verifies a speculating request's drafts in one forward pass: the request computes its
last token plus up to ``k`` drafts, the executor returns logits at each of those positions, and
core samples every position with the request's own sampling parameters. Drafts are accepted
left to right while the token sampled at a position equals the next draft; the first token that
differs (or the one after the last draft) is emitted too. Each emitted token is therefore drawn
from the target model's distribution given the tokens before it, so the output distribution is
exactly the non-speculating engine's at any temperature (greedy: accept while the argmax
matches). A proposer only decides *which* tokens are worth checking: a bad one costs speed,
never correctness.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from brigade.interfaces.request import Request

if TYPE_CHECKING:
    from brigade.interfaces.executor import Executor
    from brigade.interfaces.kv import KVManager
    from brigade.interfaces.model import Checkpoint

__all__ = ["DraftModel", "DraftSlot", "LoadModel", "Proposer", "ProposerParams"]


@dataclasses.dataclass(frozen=True, slots=True)
class DraftModel:
    """A second model that core loaded for a proposer (:attr:`ProposerParams.load_model`),
    ready to run. The proposer owns it (no other station sees it); it lives as long as the
    engine, like the served model's executor."""

    executor: Executor
    """Its weights and KV tensors (the engine's executor and attention plugins, the same page
    size and KV cache dtype as the served model); inputs are ``ModelInput`` as for any
    executor, block tables from :attr:`kv`. Under the simulator it returns token ids
    (``Executor.returns_token_ids``), and what its passes would take counts on the engine's
    virtual clock."""
    kv: KVManager
    """Pages of its own KV pool, from a new instance of the engine's KV manager plugin
    (``[kv] plugin``, prefix caching as ``[kv] enable_prefix_caching``): its requests are the
    proposer's own ``Request`` objects, never the engine's."""
    checkpoint: Checkpoint
    num_pages: int
    page_size: int
    max_model_len: int
    """The longest sequence it can run (its own limit, or the served model's if lower)."""
    vocab_size: int
    """Rows of its logits; only ids below ``ProposerParams.vocab_size`` may be drafted."""


LoadModel = Callable[..., DraftModel]
"""``load_model(path, *, dtype="auto", num_pages=0)``: load the model at ``path`` (a Hugging
Face directory or a GGUF file) as a :class:`DraftModel`. ``dtype``: ``"auto"`` (the served
model's dtype) or one of ``DTYPE_NAMES``; ``num_pages``: its KV pool (0: as many pages as the
served model's pool, so it holds every request the engine does). Raises ``ModelLoadError``
for a model it cannot load and ``ConfigError`` for one that cannot draft for the served model
(another tokenizer)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ProposerParams:
    """What core hands a proposer at construction."""

    num_speculative_tokens: int
    """The most drafts one request gets in one step (``[speculative] num_speculative_tokens``):
    every :attr:`DraftSlot.max_tokens` is at most this."""
    vocab_size: int
    """Every draft must be a token id below this."""
    max_num_seqs: int
    max_model_len: int
    checkpoint: Checkpoint | None = None
    """The served model (its tokenizer, its files), for proposers that need them; None in unit
    tests."""
    load_model: LoadModel | None = None
    """Core's loader of a second model for proposers that run one (API 2.5); None in unit
    tests that build params by hand."""


@dataclasses.dataclass(frozen=True, slots=True)
class DraftSlot:
    """One request that may speculate in the coming step."""

    request: Request
    """Read-only: ``prompt_token_ids`` and ``output_token_ids`` are its tokens so far (the last
    one is not computed yet: the drafts would follow it)."""
    max_tokens: int
    """Propose at most this many tokens (at least 1). Core's adaptive rule sets it per request
    (see docs/speculative.md); it never exceeds what the request may still generate."""


class Proposer(abc.ABC):
    """Proposes draft tokens that continue a request; core verifies them exactly.

    Constructed as ``factory(params: ProposerParams, options)`` when ``[speculative] plugin``
    names it. Every method runs on the engine's step loop, before the step is scheduled, so
    :meth:`propose` is on the hot path: keep it proportional to the tokens a request gained
    since the last call, not to all its tokens (index incrementally, keyed by
    ``request.request_id``).

    Ownership: requests are read-only. The lists :meth:`propose` returns are copied by core.
    A proposer may keep per-request state from the first :meth:`propose` that names a request
    until :meth:`remove`; a request's tokens only grow meanwhile (by one or more tokens per
    step), and a request may skip steps (it waits, is preempted, or the batch is too large to
    speculate).

    Failures never fail a request: when :meth:`propose` raises or returns something other than
    one list per slot of at most ``max_tokens`` ids in the vocabulary, core logs it and the
    step runs without drafts. A raising :meth:`observe` or :meth:`remove` is logged.
    """

    def __init__(self, params: ProposerParams, options: Any) -> None:
        self.params = params
        self.options = options

    @classmethod
    def model_to_load(cls, options: Any) -> str | None:
        """The model this proposer will load through :attr:`ProposerParams.load_model` with
        ``options`` (a path), or None. Core checks it before any weights load (``brigade
        config check`` and engine start): it opens, its architecture is supported, its
        tokenizer is the served model's. Raise ``ConfigError`` for options that name no usable
        model. Default: None (API 2.5)."""
        return None

    @abc.abstractmethod
    def propose(self, slots: Sequence[DraftSlot]) -> Sequence[Sequence[int]]:
        """Draft tokens for each slot, in order: up to ``slot.max_tokens`` ids, possibly none
        (no guess worth checking: the request decodes one token as usual)."""

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:  # noqa: B027
        """After a step verified drafts of ``request``: the first ``num_accepted`` of its
        ``num_proposed`` drafts were accepted. Its ``output_token_ids`` already hold them and
        the token sampled after them. Default: nothing."""

    def remove(self, request: Request) -> None:  # noqa: B027 - optional hook
        """``request`` left the engine (finished, aborted or failed): drop its state."""
