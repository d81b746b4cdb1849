"""Brigade's contracts: what a plugin implements and the data that crosses station boundaries.

Imports only the standard library and pluggy at runtime (torch appears in type hints only), so
a plugin package can depend on these contracts cheaply.

=================  ===================================  ==========================================
kind               contract                             factory is called as
=================  ===================================  ==========================================
``scheduler``      :class:`SchedulingPolicy`            ``factory(view, options)``
``kv``             :class:`KVManager`                   ``factory(pool_params, options)``
``executor``       :class:`Executor`                    ``factory(executor_params, options)``
``attention``      :class:`AttentionBackend`            ``factory(options)``
``sampler``        :class:`Sampler`                     ``factory(sampler_params, options)``
``logits_processor`` :class:`LogitsProcessor`           ``factory(sampler_params, options)``
``grammar``        :class:`GrammarBackend`              ``factory(grammar_params, options)``
``detokenizer``    :class:`Detokenizer`                 ``factory(tokenizer, options)``
``model``          :class:`ModelArchitecture`           ``factory()``; named by HF architecture
=================  ===================================  ==========================================

:data:`API_VERSION` versions these contracts. A plugin may declare the version it was built
for (``registry.add(..., api_version="2.0")``); Brigade refuses it at load if the MAJOR part
differs or its MINOR part is newer than Brigade's. A plugin built for 1.x is refused with a
pointer to the migration section of docs/plugins.md ("Migrating a 1.x plugin to 2.0").
"""

from brigade.interfaces.attention import AttentionBackend, AttentionLayer, PageSizeRule
from brigade.interfaces.batch import ModelInput
from brigade.interfaces.detokenizer import Detokenizer, TextDelta
from brigade.interfaces.executor import Executor, ExecutorParams, KVCacheSpec
from brigade.interfaces.grammar import GrammarBackend, GrammarMatcher, GrammarParams
from brigade.interfaces.hookspecs import BrigadeHookSpec, ComponentRegistry, hookimpl
from brigade.interfaces.kv import Allocation, KVManager, KVPoolParams, KVStats
from brigade.interfaces.model import CausalLM, Checkpoint, ModelArchitecture, SplitCausalLM
from brigade.interfaces.options import NoOptions, option
from brigade.interfaces.request import (
    EMPTY_EXTRA,
    ExtraValue,
    Request,
    RequestStatus,
    ScheduledRequest,
    SchedulerOutput,
    freeze_extra,
    is_decode,
)
from brigade.interfaces.sampler import (
    LogitsProcessor,
    SampleOutput,
    Sampler,
    SamplerParams,
    SamplingBatch,
)
from brigade.interfaces.sampling import STRUCTURED_OUTPUT_KINDS, SamplingParams, StructuredOutput
from brigade.interfaces.scheduler import SchedulerParams, SchedulerView, SchedulingPolicy

API_VERSION = "2.0"
"""The plugin API version, "MAJOR.MINOR". MINOR grows when contracts gain backwards-compatible
additions (a new optional method, a new field with a default): a plugin built for 2.0 runs on
2.1, one built for 2.1 is refused by 2.0. MAJOR grows on any change that can break an existing
plugin (a method removed or changed, a factory signature changed)."""

COMPONENT_KINDS: dict[str, type] = {
    "scheduler": SchedulingPolicy,
    "kv": KVManager,
    "executor": Executor,
    "attention": AttentionBackend,
    "sampler": Sampler,
    "logits_processor": LogitsProcessor,
    "grammar": GrammarBackend,
    "detokenizer": Detokenizer,
    "model": ModelArchitecture,
}
"""Every component kind and the contract its implementations fulfil."""

FACTORY_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "scheduler": ("view", "options"),
    "kv": ("pool_params", "options"),
    "executor": ("executor_params", "options"),
    "attention": ("options",),
    "sampler": ("sampler_params", "options"),
    "logits_processor": ("sampler_params", "options"),
    "grammar": ("grammar_params", "options"),
    "detokenizer": ("tokenizer", "options"),
    "model": (),
}
"""How core calls each kind's factory (positional arguments, in order)."""

__all__ = [
    "API_VERSION",
    "COMPONENT_KINDS",
    "EMPTY_EXTRA",
    "FACTORY_ARGUMENTS",
    "STRUCTURED_OUTPUT_KINDS",
    "Allocation",
    "AttentionBackend",
    "AttentionLayer",
    "BrigadeHookSpec",
    "CausalLM",
    "Checkpoint",
    "ComponentRegistry",
    "Detokenizer",
    "Executor",
    "ExecutorParams",
    "ExtraValue",
    "GrammarBackend",
    "GrammarMatcher",
    "GrammarParams",
    "KVCacheSpec",
    "KVManager",
    "KVPoolParams",
    "KVStats",
    "LogitsProcessor",
    "ModelArchitecture",
    "ModelInput",
    "NoOptions",
    "PageSizeRule",
    "Request",
    "RequestStatus",
    "SampleOutput",
    "Sampler",
    "SamplerParams",
    "SamplingBatch",
    "SamplingParams",
    "ScheduledRequest",
    "SchedulerOutput",
    "SchedulerParams",
    "SchedulerView",
    "SchedulingPolicy",
    "SplitCausalLM",
    "StructuredOutput",
    "TextDelta",
    "freeze_extra",
    "hookimpl",
    "is_decode",
    "option",
]
