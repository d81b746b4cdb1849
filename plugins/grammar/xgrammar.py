"""The ``xgrammar`` grammar backend: structured output on XGrammar.

:class:`XGrammarBackend` builds XGrammar's tokenizer info from the model's tokenizer (lazily,
on the first structured request), compiles grammars in worker processes
(``brigade.plugins.grammar.compile_pool``) so that the step loop never waits for a cold
schema and a compile past ``compile_timeout_s``, or one nobody waits for any more, is stopped,
and caches the compiled grammars by their :class:`~brigade.interfaces.StructuredOutput` (LRU
within ``cache_size`` grammars and ``cache_mib``, failures included, so a bad schema sent again
fails fast). What XGrammar would silently not enforce (some JSON-schema keywords, lookaround in
regexes) is refused with a message instead (``brigade.plugins.grammar.schema_checks``).
:class:`XGrammarMatcher` wraps one ``xgrammar.GrammarMatcher``; core's grammar manager drives
both.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from brigade.interfaces import (
    GrammarBackend,
    GrammarMatcher,
    GrammarParams,
    StructuredOutput,
    option,
)
from brigade.plugins.grammar.compile_pool import CompileJob, CompilePool
from brigade.plugins.grammar.compile_worker import CompileLimits
from brigade.plugins.grammar.schema_checks import check_json_schema, describe_kind

__all__ = ["XGrammarBackend", "XGrammarMatcher", "XGrammarOptions", "check_json_schema"]

logger = logging.getLogger(__name__)

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class XGrammarOptions:
    """Options of the ``xgrammar`` grammar backend (the ``[grammar]`` table)."""

    max_whitespace: int = option(
        0,
        help="JSON whitespace: 0 = compact JSON with fixed separators (', ' and ': '), so even "
        "a weak model finishes a bounded schema; N > 0 = up to N whitespace characters wherever "
        "JSON allows them",
        ge=0,
        le=64,
    )
    compile_threads: int = option(
        2,
        help="grammars compiled at once, off the step loop, each in a worker process of its "
        "own (so that a compile past its time limit, or whose clients left, is stopped)",
        ge=1,
        le=64,
    )
    max_grammar_bytes: int = option(
        256 * 1024,
        help="largest grammar a request may send (its JSON schema, regex, EBNF, choices or "
        "tools as compiled), in bytes; larger ones are refused (400) before compiling",
        ge=1024,
    )
    compile_timeout_s: float = option(
        10.0,
        help="a grammar that takes longer to compile is refused (400) and its compile stopped",
        gt=0,
        le=3600,
    )
    cache_size: int = option(256, help="compiled grammars kept (LRU, keyed by the grammar)", ge=1)
    cache_mib: int = option(
        128,
        help="memory the kept compiled grammars may take, in MiB (LRU); a grammar that "
        "compiles to more than this is refused (400)",
        ge=1,
    )


class XGrammarMatcher(GrammarMatcher):
    """One request's ``xgrammar.GrammarMatcher`` (unlimited rollback)."""

    def __init__(self, matcher: Any, non_stop: torch.Tensor, scratch: torch.Tensor) -> None:
        self._matcher = matcher
        self._non_stop = non_stop
        self._scratch = scratch

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, index)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """It took a stop token, or it is complete and allows nothing but a stop token."""
        matcher = self._matcher
        if matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        matcher.fill_next_token_bitmask(self._scratch, 0)
        return not bool((self._scratch[0] & self._non_stop).any())


class XGrammarBackend(GrammarBackend):
    """Tokenizer info, compile workers and compiled-grammar cache of one engine.

    Thread-safe: :meth:`compile` may be called from the engine thread and from the server's
    event loop at once.
    """

    def __init__(self, params: GrammarParams, options: XGrammarOptions) -> None:
        self.params = params
        self.options = options
        self.max_whitespace = options.max_whitespace
        self.cache_size = options.cache_size
        self.cache_bytes = options.cache_mib * MIB
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[StructuredOutput, CompileJob] = (
            collections.OrderedDict()
        )
        self._cached_bytes = 0
        self._pool = CompilePool(
            options.compile_threads,
            CompileLimits(
                options.max_whitespace,
                options.compile_timeout_s,
                self.cache_bytes,
                params.mask_budget_s,
            ),
            self._tokenizer_info,
        )
        words = -(-params.vocab_size // 32)
        self._scratch = torch.full((1, words), -1, dtype=torch.int32)
        self._non_stop = torch.full((words,), -1, dtype=torch.int32)
        """All tokens but the stop tokens: a complete grammar allowing none of them is over."""
        for token in params.eos_token_ids:
            if 0 <= token < params.vocab_size:
                self._non_stop[token // 32] &= ~(1 << (token % 32))

    @property
    def num_compiled(self) -> int:
        """Grammars compiled so far (cache misses)."""
        return self._pool.num_compiled

    def compile(self, spec: StructuredOutput) -> concurrent.futures.Future[Any]:
        """The compiled grammar for ``spec``, as a future of the caller's own (done at once
        on a cache hit); cancelling it stops the compile when no other caller waits for it.

        A future that fails raises ``ValueError`` with the reason (invalid schema, regex or
        grammar, a feature structured output cannot enforce, or past a limit: the grammar's
        size, its compile time, its compiled size, its first mask's time).
        """
        caller: concurrent.futures.Future[Any] = concurrent.futures.Future()
        size = len(spec.spec.encode())
        if size > self.options.max_grammar_bytes:
            caller.set_exception(
                ValueError(
                    f"the {describe_kind(spec.kind)} is {size} bytes, more than [grammar] "
                    f"max_grammar_bytes = {self.options.max_grammar_bytes} allows"
                )
            )
            return caller
        with self._lock:
            job = self._cache.get(spec)
            if job is not None:
                self._cache.move_to_end(spec)
            else:
                job = CompileJob(spec)
                self._cache[spec] = job
                job.future.add_done_callback(functools.partial(self._compiled, job))
                self._pool.submit(job)
            job.waiters += 1
        job.future.add_done_callback(functools.partial(_pass_on, caller=caller))
        caller.add_done_callback(functools.partial(self._left, job))
        return caller

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        # A scratch row of its own: core calls different matchers from different threads.
        return XGrammarMatcher(matcher, self._non_stop, torch.empty_like(self._scratch))

    def apply_bitmask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, indices: Sequence[int]
    ) -> None:
        """XGrammar's fused kernel (CPU and CUDA)."""
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.params.vocab_size, indices=list(indices)
        )

    def warm_up(self) -> None:
        """Import XGrammar and build the tokenizer info now: both hold the GIL for a while,
        which the first structured request would otherwise take from the step loop."""
        import xgrammar  # noqa: F401

        with contextlib.suppress(ValueError):  # no tokenizer: compile() says so
            self._pool.tokenizer()

    def shutdown(self) -> None:
        self._pool.shutdown()

    # -- the cache ----------------------------------------------------------------------

    def _left(self, job: CompileJob, caller: concurrent.futures.Future[Any]) -> None:
        """A caller's future is done: answered, or cancelled (its request left)."""
        with self._lock:
            job.waiters -= 1
            if not caller.cancelled() or job.waiters > 0 or job.future.done():
                return
            if self._cache.get(job.spec) is job:
                del self._cache[job.spec]
        self._pool.cancel(job)  # killed if it runs
        job.future.cancel()

    def _compiled(self, job: CompileJob, done: concurrent.futures.Future[Any]) -> None:
        """A compile finished: count its memory, then evict down to the cache's bounds."""
        if job.future.cancelled():
            return
        with self._lock:
            if self._cache.get(job.spec) is not job:
                return
            self._cached_bytes += _size(job)
            while len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes:
                oldest = next(
                    (spec for spec, old in self._cache.items() if old.future.done()), None
                )
                if oldest is None:
                    break  # only compiles in flight: never drop one
                self._cached_bytes -= _size(self._cache.pop(oldest))

    def _tokenizer_info(self) -> tuple[Any, str]:
        """XGrammar's view of the model's vocabulary, and its serialized form for workers."""
        import xgrammar as xgr

        checkpoint = self.params.checkpoint
        tokenizer = checkpoint.tokenizer() if checkpoint is not None else None
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer; this engine has none")
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer,
            vocab_size=self.params.vocab_size,
            stop_token_ids=list(self.params.eos_token_ids) or None,
        )
        return info, info.serialize_json()


def _pass_on(done: concurrent.futures.Future[Any], caller: concurrent.futures.Future[Any]) -> None:
    """The shared compile's outcome, into one caller's future (unless it gave up)."""
    if caller.done():
        return
    try:
        if done.cancelled():
            caller.cancel()
        elif done.exception() is not None:
            caller.set_exception(done.exception())
        else:
            caller.set_result(done.result())
    except concurrent.futures.InvalidStateError:  # cancelled meanwhile
        pass


def _size(job: CompileJob) -> int:
    """Memory a finished compile holds (a failure: none)."""
    future = job.future
    if future.cancelled() or future.exception() is not None:
        return 0
    return int(future.result().memory_size_bytes)
