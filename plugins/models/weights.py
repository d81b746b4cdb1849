"""Where each checkpoint tensor goes in the decoder: the fused rows it fills and, under tensor
parallelism, the slice of it this rank holds (``brigade.plugins.models.parallel``)."""

from __future__ import annotations

import dataclasses

import torch

from brigade.plugins.models.decoder import DecoderForCausalLM
from brigade.plugins.models.parallel import Shard, TensorParallel

__all__ = ["Target", "checkpoint_targets"]

_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
"""Fused module -> the checkpoint modules stacked (in order) along its output rows."""

_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
"""Modules whose input columns are split: each rank's output is a partial sum."""

_VOCAB_PARALLEL = ("embed_tokens", "lm_head")


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """Where one checkpoint tensor (or this rank's slice of it) is copied."""

    param: torch.Tensor
    start: int
    """First row of ``param`` it fills (fused parameters stack several tensors)."""
    rows: int
    shard: Shard | None = None
    """The slice of the checkpoint tensor this rank holds; None: all of it."""


def checkpoint_targets(model: DecoderForCausalLM) -> dict[str, Target]:
    """HF checkpoint name -> :class:`Target`; a fused parameter appears once per checkpoint
    tensor stacked into it."""
    targets: dict[str, Target] = {}
    tp = model.tp
    for name, param in model.named_parameters():
        module_path, _, kind = name.rpartition(".")
        hf_prefix = "" if name.startswith("lm_head.") else "model."
        fused = next((f for f in _FUSED if module_path.endswith(f)), None)
        if fused is None:
            shard = None if tp is None else _unfused_shard(module_path, kind, param, tp)
            targets[hf_prefix + name] = Target(param, 0, param.shape[0], shard)
            continue
        base = module_path[: -len(fused)]
        start = 0
        for part, (first, rows) in zip(_FUSED[fused], _fused_parts(model, fused), strict=True):
            shard = None if tp is None else Shard(0, first, rows)
            targets[f"{hf_prefix}{base}{part}.{kind}"] = Target(param, start, rows, shard)
            start += rows
    return targets


def _unfused_shard(
    module_path: str, kind: str, param: torch.Tensor, tp: TensorParallel
) -> Shard | None:
    if module_path.endswith(_VOCAB_PARALLEL):
        return Shard(0, tp.rank * param.shape[0], param.shape[0])
    if module_path.endswith(_ROW_PARALLEL):
        if kind == "bias":  # added once, after the sum: rank 0 holds it, the others zeros
            return None if tp.rank == 0 else Shard(0, 0, param.shape[0], zero=True)
        return Shard(1, tp.rank * param.shape[1], param.shape[1])
    return None  # norms: every rank holds all of them


def _fused_parts(model: DecoderForCausalLM, fused: str) -> tuple[tuple[int, int], ...]:
    """(first checkpoint row, rows) of each tensor stacked into ``fused`` on this rank."""
    config = model.config
    tp = model.tp
    if fused == "mlp.gate_up_proj":
        share = config.intermediate_size if tp is None else config.intermediate_size // tp.size
        first = 0 if tp is None else tp.rank * share
        return ((first, share), (first, share))
    layer = model.attention_layers[0]
    head_dim = layer.head_dim
    q_first = 0 if tp is None else tp.rank * layer.num_heads
    kv_first = 0 if tp is None else tp.kv_heads(config.num_kv_heads)[0]
    q = (q_first * head_dim, layer.num_heads * head_dim)
    kv = (kv_first * head_dim, layer.num_kv_heads * head_dim)
    return (q, kv, kv)
