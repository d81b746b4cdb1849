"""Registers Brigade's built-in components (entry point ``brigade.builtins``)."""

from __future__ import annotations

from brigade.interfaces import ComponentRegistry, hookimpl
from brigade.plugins.attention.flash_attn import FlashAttentionBackend
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.plugins.attention.triton_backend import TritonAttentionOptions, TritonBackend
from brigade.plugins.cpu.attention import CpuAttentionBackend, CpuAttentionOptions
from brigade.plugins.detokenizers.incremental import (
    IncrementalDetokenizer,
    IncrementalDetokenizerOptions,
)
from brigade.plugins.executors.cuda_graph import CudaGraphExecutor, CudaGraphExecutorOptions
from brigade.plugins.executors.simulated import SimulatedExecutor, SimulatedExecutorOptions
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions
from brigade.plugins.grammar.xgrammar import XGrammarBackend, XGrammarOptions
from brigade.plugins.kv.paged import PagedKVManager, PagedKVOptions
from brigade.plugins.kv.radix import RadixKVManager, RadixKVOptions
from brigade.plugins.models.architectures import ARCHITECTURES
from brigade.plugins.proposers.draft_model import DraftModelOptions, DraftModelProposer
from brigade.plugins.proposers.ngram import NgramOptions, NgramProposer
from brigade.plugins.proposers.repeat import RepeatLastProposer
from brigade.plugins.proposers.suffix import SuffixOptions, SuffixProposer
from brigade.plugins.routers.builtin import (
    CacheAwareOptions,
    CacheAwareRouter,
    LeastLoadedRouter,
    RoundRobinRouter,
    RouterNoOptions,
)
from brigade.plugins.samplers.ban_words import BanWordsOptions, BanWordsProcessor
from brigade.plugins.samplers.standard import StandardSampler, StandardSamplerOptions
from brigade.plugins.schedulers.cache_aware import LongestPrefixOptions, LongestPrefixPolicy
from brigade.plugins.schedulers.fcfs import FcfsOptions, FcfsPolicy
from brigade.plugins.schedulers.priority import PriorityOptions, PriorityPolicy


@hookimpl
def brigade_register(registry: ComponentRegistry) -> None:
    """Add every built-in component."""
    registry.add("scheduler", "fcfs", FcfsPolicy, options=FcfsOptions)
    registry.add("scheduler", "priority", PriorityPolicy, options=PriorityOptions)
    registry.add("scheduler", "lpm", LongestPrefixPolicy, options=LongestPrefixOptions)
    registry.add("kv", "paged", PagedKVManager, options=PagedKVOptions)
    registry.add("kv", "radix", RadixKVManager, options=RadixKVOptions)
    registry.add("executor", "torch", TorchExecutor, options=TorchExecutorOptions)
    registry.add("executor", "simulated", SimulatedExecutor, options=SimulatedExecutorOptions)
    registry.add("executor", "cuda-graph", CudaGraphExecutor, options=CudaGraphExecutorOptions)
    registry.add("attention", "sdpa", SdpaBackend)
    registry.add("attention", "cpu", CpuAttentionBackend, options=CpuAttentionOptions)
    registry.add("attention", "triton", TritonBackend, options=TritonAttentionOptions)
    registry.add("attention", "flash-attn", FlashAttentionBackend)
    registry.add("sampler", "standard", StandardSampler, options=StandardSamplerOptions)
    registry.add("grammar", "xgrammar", XGrammarBackend, options=XGrammarOptions)
    registry.add("logits_processor", "ban-words", BanWordsProcessor, options=BanWordsOptions)
    registry.add(
        "detokenizer", "incremental", IncrementalDetokenizer, options=IncrementalDetokenizerOptions
    )
    registry.add("router", "round-robin", RoundRobinRouter, options=RouterNoOptions)
    registry.add("router", "least-loaded", LeastLoadedRouter, options=RouterNoOptions)
    registry.add("router", "cache-aware", CacheAwareRouter, options=CacheAwareOptions)
    registry.add("proposer", "ngram", NgramProposer, options=NgramOptions)
    registry.add("proposer", "suffix", SuffixProposer, options=SuffixOptions)
    registry.add("proposer", "repeat-last", RepeatLastProposer)
    registry.add("proposer", "draft-model", DraftModelProposer, options=DraftModelOptions)
    for hf_name, architecture in ARCHITECTURES.items():
        registry.add("model", hf_name, architecture)
