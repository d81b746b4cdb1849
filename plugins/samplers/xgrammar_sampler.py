"""The ``xgrammar`` sampler: the standard sampler plus the grammar stage (structured output)."""

from __future__ import annotations

import dataclasses

from brigade.interfaces import SamplerParams, option
from brigade.plugins.samplers.grammar import GrammarBackend, GrammarProcessor
from brigade.plugins.samplers.standard import StandardSampler, StandardSamplerOptions

__all__ = ["XGrammarSampler", "XGrammarSamplerOptions"]


@dataclasses.dataclass(frozen=True)
class XGrammarSamplerOptions:
    """Options of the ``xgrammar`` sampler."""

    max_whitespace: int = option(
        0,
        help="JSON whitespace: 0 = compact JSON with fixed separators (', ' and ': '), so even "
        "a weak model finishes a bounded schema; N > 0 = up to N whitespace characters wherever "
        "JSON allows them",
        ge=0,
        le=64,
    )
    compile_threads: int = option(
        2, help="threads compiling grammars off the step loop", ge=1, le=64
    )
    cache_size: int = option(256, help="compiled grammars kept (LRU, keyed by the grammar)", ge=1)


class XGrammarSampler(StandardSampler):
    """``standard`` with XGrammar-constrained decoding for requests with structured output."""

    def __init__(self, params: SamplerParams, options: XGrammarSamplerOptions) -> None:
        super().__init__(params, StandardSamplerOptions())
        self.backend = GrammarBackend(
            params,
            max_whitespace=options.max_whitespace,
            compile_threads=options.compile_threads,
            cache_size=options.cache_size,
        )
        # The grammar stage runs last: whatever the others add (the configured processors
        # included), a token the grammar masks stays -inf.
        self._processors = (*self._processors, GrammarProcessor(params, self.backend))
