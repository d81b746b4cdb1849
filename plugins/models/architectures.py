"""Model architectures: the shared decoder under each Hugging Face ``architectures`` name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from brigade.interfaces import (
    AttentionBackend,
    CausalLM,
    Checkpoint,
    ModelArchitecture,
    ModelLoadError,
)
from brigade.plugins.models.config import Family, parse_decoder_config
from brigade.plugins.models.decoder import DecoderForCausalLM
from brigade.plugins.models.parallel import Shard, TensorParallel, check_shardable
from brigade.plugins.models.weights import checkpoint_targets

__all__ = [
    "ARCHITECTURES",
    "DecoderArchitecture",
    "LlamaArchitecture",
    "MistralArchitecture",
    "Qwen2Architecture",
    "Qwen3Architecture",
]

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Checkpoint tensors some exporters write that are computed, not loaded."""


class DecoderArchitecture(ModelArchitecture):
    """The shared decoder; a subclass names its :class:`Family`."""

    family: ClassVar[Family]

    def validate_config(self, hf_config: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the key if this family cannot run ``hf_config``."""
        parse_decoder_config(hf_config, self.family)

    def check_split(self, hf_config: Mapping[str, Any], tp_size: int) -> None:
        """``ConfigError`` naming ``[executor] tensor_parallel_size`` unless the model splits
        over ``tp_size`` ranks (heads, KV heads, MLP columns)."""
        config = parse_decoder_config(hf_config, self.family)
        check_shardable(
            tp_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            intermediate_size=config.intermediate_size,
        )

    def build(
        self,
        hf_config: Mapping[str, Any],
        attention: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None = None,
    ) -> CausalLM:
        """The decoder with uninitialised weights on ``device`` (RoPE cache computed); with
        ``tp``, this rank's shard (``ConfigError`` when the model does not split that way)."""
        if tp is not None:
            self.check_split(hf_config, tp.size)
        config = parse_decoder_config(hf_config, self.family)
        if any(w is not None for w in config.sliding_windows) and not (
            attention.supports_sliding_window
        ):
            raise ValueError(
                f"sliding_window: this {self.family.architecture} uses sliding-window "
                f"attention, which attention backend {attention.name!r} does not support"
            )
        with torch.device("meta"):
            model = DecoderForCausalLM(config, attention, dtype, tp)
        allocate(model, device)
        model.initialize_rope()
        return model

    def load_checkpoint(
        self, model: CausalLM, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device
    ) -> None:
        """:meth:`load_weights` from ``checkpoint``; a tensor-parallel shard asks it for its
        slices only (``Checkpoint.weight_slices``)."""
        if not isinstance(model, DecoderForCausalLM) or model.tp is None:
            self.load_weights(model, checkpoint.weights(dtype, device))
            return
        targets = checkpoint_targets(model)

        def slice_of(name: str) -> tuple[int, int, int] | None:
            shard = target.shard if (target := targets.get(name)) is not None else None
            return None if shard is None else (shard.dim, shard.start, shard.length)

        self.load_weights(model, checkpoint.weight_slices(dtype, device, slice_of))

    def load_weights(self, model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into ``model``, stacking q/k/v and gate/up into fused rows.
        A tensor-parallel shard takes each tensor whole or already narrowed to its slice."""
        if not isinstance(model, DecoderForCausalLM):
            raise TypeError(f"expected a model built by {type(self).__name__}, got {model!r}")
        targets = checkpoint_targets(model)
        tied = model.lm_head is None
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                target = targets.get(name)
                if target is None:
                    raise ModelLoadError(
                        f"checkpoint tensor {name!r} has no place in a {self.family.architecture} "
                        "with this config.json (check the architectures name and config keys "
                        "such as attention_bias, mlp_bias, tie_word_embeddings)"
                    )
                destination = target.param.narrow(0, target.start, target.rows)
                if target.shard is not None:
                    tensor, destination = _shard_of(tensor, destination, target.shard)
                if tuple(tensor.shape) != tuple(destination.shape):
                    raise ModelLoadError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, but "
                        f"config.json implies {tuple(destination.shape)}"
                    )
                destination.copy_(tensor)
                loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
        if tied:
            model.tie_lm_head()


def _shard_of(
    tensor: torch.Tensor, destination: torch.Tensor, shard: Shard
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's slice of ``tensor``, the part of ``destination`` it fills): narrows a
    whole checkpoint tensor (a pre-sliced one is left as it is), zeroes the padding rows of a
    vocabulary shard past the vocabulary's end, and a zero shard's whole destination."""
    if shard.zero:
        destination.zero_()
        return destination, destination
    size = tensor.shape[shard.dim]
    if size > shard.length:  # the whole tensor (a slice is at most shard.length long)
        # [.., size, ..] -> [.., length (less at the vocabulary's end), ..]
        tensor = tensor.narrow(shard.dim, shard.start, min(shard.length, size - shard.start))
    available = tensor.shape[shard.dim]
    if available < shard.length:  # the last vocabulary shard: rows past the vocabulary
        destination.narrow(shard.dim, available, shard.length - available).zero_()
        destination = destination.narrow(shard.dim, 0, available)
    return tensor, destination


class LlamaArchitecture(DecoderArchitecture):
    family = Family(
        "LlamaForCausalLM",
        qkv_bias=None,
        o_bias=None,
        reads_mlp_bias=True,
        qk_norm=False,
        sliding="none",
        default_max_positions=2048,
    )


class MistralArchitecture(DecoderArchitecture):
    family = Family(
        "MistralForCausalLM",
        qkv_bias=False,
        o_bias=False,
        reads_mlp_bias=False,
        qk_norm=False,
        sliding="all_layers",
        default_max_positions=131072,
        default_sliding_window=4096,
    )


class Qwen2Architecture(DecoderArchitecture):
    family = Family(
        "Qwen2ForCausalLM",
        qkv_bias=True,
        o_bias=False,
        reads_mlp_bias=False,
        qk_norm=False,
        sliding="qwen",
        default_max_positions=32768,
    )


class Qwen3Architecture(DecoderArchitecture):
    family = Family(
        "Qwen3ForCausalLM",
        qkv_bias=None,
        o_bias=None,
        reads_mlp_bias=False,
        qk_norm=True,
        sliding="qwen",
        default_max_positions=32768,
        default_head_dim=128,
    )


ARCHITECTURES: dict[str, type[ModelArchitecture]] = {
    arch.family.architecture: arch
    for arch in (LlamaArchitecture, MistralArchitecture, Qwen2Architecture, Qwen3Architecture)
}
"""HF ``architectures`` name -> zero-argument factory of its :class:`ModelArchitecture`."""


def allocate(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)`` for a model built on the meta device, without
    ``to_empty``'s meta-tensor path: its first call imports sympy, ~1 s of every engine
    start. Each parameter and buffer gets uninitialised memory on ``device``."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))
