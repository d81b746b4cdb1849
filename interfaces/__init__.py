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
``proposer``       :class:`Proposer`                    ``factory(proposer_params, options)``
=================  ===================================  ==========================================

:data:`API_VERSION` versions these contracts. A plugin may declare the version it was built
for (``registry.add(..., api_version="2.0")``); Brigade refuses it at load if the MAJOR part
differs or its MINOR part is newer than Brigade's. A plugin built for 1.x is refused with a
pointer to the migration section of docs/plugins.md ("Migrating a 1.x plugin to 2.0").

A plugin imports from Brigade only these contracts (errors included) and the few modules of
:data:`PUBLIC_MODULES`; everything else in ``brigade`` is core's and may change without notice.
"""

from brigade.interfaces.attention import AttentionBackend, AttentionLayer, PageSizeRule
from brigade.interfaces.batch import ModelInput
from brigade.interfaces.detokenizer import Detokenizer, TextDelta
from brigade.interfaces.errors import BrigadeError, ConfigError, ModelLoadError, RequestError
from brigade.interfaces.executor import Executor, ExecutorParams, KVCacheSpec
from brigade.interfaces.grammar import GrammarBackend, GrammarMatcher, GrammarParams
from brigade.interfaces.hookspecs import BrigadeHookSpec, ComponentRegistry, hookimpl
from brigade.interfaces.kv import Allocation, KVManager, KVPoolParams, KVStats
from brigade.interfaces.model import (
    AcceptsLayerOps,
    CausalLM,
    Checkpoint,
    DecoderLayerWeights,
    DecoderWeights,
    LayerOps,
    LayerOpsProvider,
    ModelArchitecture,
    ProvidesDecoderWeights,
    SplitCausalLM,
)
from brigade.interfaces.options import NoOptions, option
from brigade.interfaces.proposer import (
    DraftModel,
    DraftSlot,
    LoadModel,
    Proposer,
    ProposerParams,
)
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
from brigade.interfaces.router import ReplicaLoad, Router, RouterParams
from brigade.interfaces.sampler import (
    LogitsProcessor,
    SampleOutput,
    Sampler,
    SamplerParams,
    SamplingBatch,
)
from brigade.interfaces.sampling import (
    POOLING_MODES,
    STRUCTURED_OUTPUT_KINDS,
    PoolingParams,
    SamplingParams,
    StructuredOutput,
)
from brigade.interfaces.scheduler import SchedulerParams, SchedulerView, SchedulingPolicy

API_VERSION = "2.7"
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
    "router": Router,
    "proposer": Proposer,
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
    "router": ("router_params", "options"),
    "proposer": ("proposer_params", "options"),
}
"""How core calls each kind's factory (positional arguments, in order)."""

PUBLIC_MODULES: tuple[str, ...] = (
    "brigade.interfaces",
    "brigade.testing",
    "brigade.cache",
    "brigade.model_input",
)
"""What a plugin may import from Brigade (each with its submodules): the contracts, the
conformance kit for its own tests, ``cache_root()`` for what it builds once (compiled kernels),
and ``build_model_input``, the reference builder of a :class:`ModelInput` (warm-up steps,
backend tests). Built-in plugins may also use each other, a package (``brigade.plugins.<name>``)
only through what its root exports; anything else a plugin needs, core hands it in the
factory's params.
``tests/plugin_api/test_plugin_imports.py`` holds the built-ins and the example plugin to this."""

__all__ = [
    "API_VERSION",
    "COMPONENT_KINDS",
    "EMPTY_EXTRA",
    "FACTORY_ARGUMENTS",
    "POOLING_MODES",
    "PUBLIC_MODULES",
    "PoolingParams",
    "STRUCTURED_OUTPUT_KINDS",
    "AcceptsLayerOps",
    "Allocation",
    "AttentionBackend",
    "AttentionLayer",
    "BrigadeError",
    "BrigadeHookSpec",
    "CausalLM",
    "Checkpoint",
    "ComponentRegistry",
    "ConfigError",
    "DecoderLayerWeights",
    "DecoderWeights",
    "Detokenizer",
    "DraftModel",
    "DraftSlot",
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
    "LayerOps",
    "LayerOpsProvider",
    "LogitsProcessor",
    "ModelArchitecture",
    "ModelInput",
    "ModelLoadError",
    "NoOptions",
    "PageSizeRule",
    "LoadModel",
    "Proposer",
    "ProposerParams",
    "ProvidesDecoderWeights",
    "Request",
    "RequestError",
    "ReplicaLoad",
    "RequestStatus",
    "Router",
    "RouterParams",
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
