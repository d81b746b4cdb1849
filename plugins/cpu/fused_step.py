"""A step's decoder layers in one C++ call, on a CPU in float32 or bfloat16.

At decode batch sizes the eager forward spends a large share of a step in Python and operator
dispatch (~40 calls per layer around its four GEMMs: module calls, views, the KV write, the
attention kernel, the fused small operations); a mixed step of 2048 tokens spent ~18 ms of its
~340 there. ``torch.ops.brigade_cpu.decode_layers`` runs every layer with the same kernels in
the same order, so its result is identical to the eager forward's (tested bit for bit): decode
steps, and steps with prefill chunks where the ``cpu`` attention backend would run its C++
prefill kernel (``native_prefill``). The executor runs it in place of the layers when
:meth:`CpuDecodeLayers.run` takes the step; the layers one by one remain the path for other
attention backends, dtypes and devices, prefills without the C++ kernel, and models with qk
norm (Qwen3). It reads the model's layers as data (``DecoderWeights``), not its modules. The linear
layers are called as the eager forward calls them: the panel or tile GEMM or oneDNN on the
weight of a ``CpuLinear``, F.linear for a plain ``nn.Linear``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from brigade.interfaces import DecoderWeights
from brigade.plugins.attention import SdpaMetadata
from brigade.plugins.cpu.attention import CpuAttentionBackend
from brigade.plugins.cpu.build import cpu_ops
from brigade.plugins.cpu.gemm import CpuLinear
from brigade.plugins.cpu.layer_ops import KERNEL_DTYPES

__all__ = ["CpuDecodeLayers"]


class CpuDecodeLayers:
    """A decoder's per-layer weights laid out for ``decode_layers``; :meth:`run` takes a step
    when it can (else None, and the caller runs the layers one by one)."""

    def __init__(self, weights: DecoderWeights) -> None:
        self.weights = weights
        """The layers as the executor will run them (after it swapped their linear modules)."""
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
            hidden.device.type != "cpu"
            or hidden.dtype not in KERNEL_DTYPES
            or not isinstance(metadata, SdpaMetadata)
            or torch.compiler.is_compiling()
        ):
            return None
        ops = cpu_ops()
        if ops is None or not self._can_run(hidden.device):
            return None
        if any(k.dtype not in KERNEL_DTYPES for k, _ in kv_caches):
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

    @property
    def _backend(self) -> CpuAttentionBackend:
        backend = self.weights.layers[0].backend
        assert isinstance(backend, CpuAttentionBackend)  # checked by _can_run
        return backend

    def _prefill_kind(
        self, hidden: torch.Tensor, key_cache: torch.Tensor, metadata: SdpaMetadata
    ) -> int | None:
        """``decode_layers``' prefill argument for this step: 0 for a pure decode step, 1 or 2
        for the backend's C++ prefill kernel (vector, AMX tiles) on its chunks; None when the
        backend would attend to the chunks otherwise (the layers run one by one then)."""
        if not metadata.prefill_rows:
            return 0 if metadata.num_decodes == hidden.shape[0] else None
        first = self.weights.layers[0]
        kernel = self._backend.prefill_kernel(hidden, key_cache, first.attention)
        if kernel is None:
            return None
        return 2 if kernel.tiles else 1

    def _can_run(self, device: torch.device) -> bool:
        """Whether these layers are ones the fused call reproduces exactly: one ``cpu``
        backend with its C++ decode kernel, no qk norm, one GEMM kind, gate_up projections
        paired or not alike."""
        if self._usable is None:
            layers = self.weights.layers
            backend = layers[0].backend if layers else None
            self._usable = (
                isinstance(backend, CpuAttentionBackend)
                and all(layer.backend is backend for layer in layers)
                and backend.decode_kernel(device) is not None
                and not any(layer.qk_norm for layer in layers)
                and len({_gemm_kind(m) for m in self._linears()}) == 1
                and len({_paired(layer.gate_up_proj) for layer in layers}) == 1
            )
        return self._usable

    def _layout(self) -> tuple[Any, ...]:
        if self._args is None:
            weights: list[torch.Tensor] = []
            biases: list[torch.Tensor | None] = []
            windows: list[int] = []
            for layer in self.weights.layers:
                linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
                weights += [
                    layer.input_norm,
                    _gemm_weight(layer.qkv_proj),
                    _gemm_weight(layer.o_proj),
                    layer.post_attention_norm,
                    _gemm_weight(layer.gate_up_proj),
                    _gemm_weight(layer.down_proj),
                ]
                biases += [_bias(linear) for linear in linears]
                windows.append(layer.attention.sliding_window or 0)
            first = self.weights.layers[0]
            spec = first.attention
            sizes = (
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                self.weights.rms_norm_eps,
                spec.scale,
                _gemm_kind(first.qkv_proj),
                self._backend.cascade,
                self.weights.intermediate_size,
                _paired(first.gate_up_proj),
            )
            self._args = (weights, biases, windows, sizes)
        return self._args

    def _linears(self) -> list[nn.Module]:
        return [
            module
            for layer in self.weights.layers
            for module in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
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


def _bias(linear: nn.Module) -> torch.Tensor | None:
    bias = linear.bias
    assert bias is None or isinstance(bias, torch.Tensor)
    return bias
