"""A step's decoder layers in one C++ call, on a CPU in float32 or bfloat16.

At decode batch sizes the eager forward spends a large share of a step in Python and operator
dispatch (~40 calls per layer around its four GEMMs: module calls, views, the KV write, the
attention kernel, the fused small operations); a mixed step of 2048 tokens spent ~18 ms of its
~340 there. ``torch.ops.brigade_cpu.decode_layers`` runs every layer with the same kernels in
the same order, so its result is identical to the eager forward's (tested bit for bit): decode
steps, and steps with prefill chunks where the sdpa backend would run its C++ prefill kernel
(``native_prefill``). The eager forward remains the path for other attention backends, dtypes
and devices, prefills without the C++ kernel, and models with qk norm (Qwen3). The linear
layers are called as the eager forward calls them: the panel or tile GEMM or oneDNN on the
weight of a ``CpuLinear``, F.linear for a plain ``nn.Linear``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from brigade.plugins.attention.sdpa import SdpaBackend, SdpaMetadata
from brigade.plugins.cpu.gemm import CpuLinear

__all__ = ["CpuDecodeLayers"]


class CpuDecodeLayers:
    """The model's per-layer weights laid out for ``decode_layers``; :meth:`run` takes a step
    when it can (else None, and the caller runs the eager layers)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        """The ``DecoderForCausalLM`` (which builds this in its constructor)."""
        self.enabled = True
        """False keeps the eager layers (a reference, or ``[executor] fused_decode = false``)."""
        self._args: tuple[Any, ...] | None = None
        self._usable: bool | None = None

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: Any,
    ) -> torch.Tensor | None:
        """The residual stream after every layer of the step, or None when this step is not
        one the fused call covers."""
        if (
            not self.enabled
            or hidden.device.type != "cpu"
            or not isinstance(metadata, SdpaMetadata)
        ):
            return None
        ops = self.model.fusion.ops(hidden)
        if ops is None or not self._can_run(hidden.device):
            return None
        if any(k.dtype not in (torch.float32, torch.bfloat16) for k, _ in kv_caches):
            return None
        prefill = self._prefill_kind(hidden, kv_caches[0][0], metadata)
        if prefill is None:
            return None
        weights, biases, windows, sizes = self._layout()
        return ops.decode_layers(
            hidden,
            cos,
            sin,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.seq_lens,
            weights,
            biases,
            windows,
            *sizes,
            metadata.num_decodes,
            metadata.prefill_chunks,
            prefill,
        )

    def _prefill_kind(
        self, hidden: torch.Tensor, key_cache: torch.Tensor, metadata: SdpaMetadata
    ) -> int | None:
        """``decode_layers``' prefill argument for this step: 0 for a pure decode step, 1 or 2
        for the sdpa backend's C++ prefill kernel (vector, AMX tiles) on its chunks; None when
        the backend would attend to the chunks otherwise (the eager layers run then)."""
        if not metadata.prefill_rows:
            return 0 if metadata.num_decodes == hidden.shape[0] else None
        first = self.model.decoder_layers[0].self_attn
        kernel = first.backend._prefill_kernel(hidden, key_cache, first.layer)
        if kernel is None:
            return None
        return 2 if kernel is first.backend._prefill_tiles else 1

    def _can_run(self, device: torch.device) -> bool:
        """Whether this model's layers are ones the fused call reproduces exactly."""
        if self._usable is None:
            layers = self.model.decoder_layers
            backends = {id(layer.self_attn.backend) for layer in layers}
            backend = layers[0].self_attn.backend
            self._usable = (
                len(backends) == 1
                and isinstance(backend, SdpaBackend)
                and backend._decode_kernel(device) is not None
                and all(layer.self_attn.q_norm is None for layer in layers)
                and len({_gemm_kind(m) for m in self._linears()}) == 1
                and len({_paired(layer.mlp.gate_up_proj) for layer in layers}) == 1
                and len({n.eps for n in self._norms()}) == 1
            )
        return self._usable

    def _layout(self) -> tuple[Any, ...]:
        if self._args is None:
            weights: list[torch.Tensor] = []
            biases: list[torch.Tensor | None] = []
            windows: list[int] = []
            for layer in self.model.decoder_layers:
                attention, mlp = layer.self_attn, layer.mlp
                linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
                weights += [
                    layer.input_layernorm.weight,
                    _gemm_weight(attention.qkv_proj),
                    _gemm_weight(attention.o_proj),
                    layer.post_attention_layernorm.weight,
                    _gemm_weight(mlp.gate_up_proj),
                    _gemm_weight(mlp.down_proj),
                ]
                biases += [linear.bias for linear in linears]
                windows.append(attention.layer.sliding_window or 0)
            first = self.model.decoder_layers[0]
            spec = first.self_attn.layer
            sizes = (
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                first.input_layernorm.eps,
                spec.scale,
                _gemm_kind(first.self_attn.qkv_proj),
                first.self_attn.backend.cascade,
                first.mlp.intermediate_size,
                _paired(first.mlp.gate_up_proj),
            )
            self._args = (weights, biases, windows, sizes)
        return self._args

    def _linears(self) -> list[nn.Module]:
        return [
            module
            for layer in self.model.decoder_layers
            for module in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        ]

    def _norms(self) -> list[Any]:
        return [
            norm
            for layer in self.model.decoder_layers
            for norm in (layer.input_layernorm, layer.post_attention_layernorm)
        ]


def _gemm_kind(linear: nn.Module) -> int:
    """How ``decode_layers`` runs this layer: 0 F.linear, 1 oneDNN, 2 the panel GEMM, 3 the
    tile GEMM."""
    if not isinstance(linear, CpuLinear):
        return 0
    return {"panels": 2, "tiles": 3}.get(linear.layout, 1)


def _paired(linear: nn.Module) -> bool:
    """Whether this gate_up projection is packed in pairs (its SiLU-mul done in the GEMM)."""
    return isinstance(linear, CpuLinear) and linear.paired


def _gemm_weight(linear: nn.Module) -> torch.Tensor:
    """The weight the eager forward's GEMM reads for this layer (packed, or as loaded)."""
    if isinstance(linear, CpuLinear):
        return linear.gemm_weight
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    return weight
