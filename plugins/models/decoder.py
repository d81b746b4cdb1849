"""The decoder shared by Llama, Mistral, Qwen2 and Qwen3, reading and writing the paged KV.

Projections are fused: one Linear makes q, k and v, one makes the MLP's gate and up halves.
Module names otherwise mirror transformers' so checkpoint names map one to one.

The forward is a chain of pieces split at attention (``SplitCausalLM``), so an executor can
run the dense pieces as CUDA graphs and attention eagerly (piecewise capture), or the pieces
layer by layer itself: :meth:`DecoderForCausalLM.embed`, then per layer ``attention_input``
(input norm, qkv, qk norm, RoPE), ``attend`` (the backend: KV write and attention) and
``finish_layer`` (o_proj, residual, MLP, residual), then ``final_norm``. The model-level
methods only pick the layer; :meth:`DecoderForCausalLM.forward` calls the same layer methods,
so every path runs one implementation.

The small operations between the GEMMs (RMSNorm, the residual add before the post-attention
norm, SiLU-mul, RoPE) are torch's, as transformers runs them, unless the executor hands the
model fused ones (``AcceptsLayerOps.use_layer_ops``: the CPU's C++ kernels, Triton on a GPU).
The model describes its layers as data (``ProvidesDecoderWeights``) for an executor that runs
a whole step its own way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from brigade.interfaces import (
    AttentionBackend,
    AttentionLayer,
    DecoderLayerWeights,
    DecoderWeights,
    LayerOps,
    LayerOpsProvider,
)
from brigade.plugins.models.config import DecoderConfig
from brigade.plugins.models.parallel import TensorParallel, all_reduce, gather_vocab
from brigade.plugins.models.rope import apply_rope, rope_cos_sin

__all__ = ["DecoderForCausalLM", "RMSNorm"]


class _LayerOpsSlot:
    """The provider of fused operations the executor handed the model, shared by its modules
    (one slot per model: :meth:`DecoderForCausalLM.use_layer_ops` fills it)."""

    def __init__(self) -> None:
        self.provider: LayerOpsProvider | None = None

    def ops(self, x: torch.Tensor) -> LayerOps | None:
        """The fused operations for eager tensors like ``x``; None without a provider, where it
        has none for ``x``, and under torch.compile (which fuses the torch operations)."""
        if self.provider is None or torch.compiler.is_compiling():
            return None
        return self.provider(x)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 like transformers."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, slot: _LayerOpsSlot | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps
        self.slot = slot or _LayerOpsSlot()
        """Where the fused operations come from (a norm of its own: torch's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., size] -> same shape and dtype."""
        if x.dim() == 2 and (ops := self.slot.ops(x)) is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: DecoderConfig,
        layer: AttentionLayer,
        backend: AttentionBackend,
        dtype: torch.dtype,
        slot: _LayerOpsSlot,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.backend = backend
        self.slot = slot
        # This rank's heads (all of them without tensor parallelism).
        q_size = layer.num_heads * layer.head_dim
        kv_size = layer.num_kv_heads * layer.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(
            config.hidden_size, sum(self.split_sizes), bias=config.qkv_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias, dtype=dtype)
        self.q_norm = (
            RMSNorm(layer.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(layer.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        )

    def project(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed hidden [T, hidden_size] -> q [T, heads, head_dim], k and v [T, kv_heads,
        head_dim], with qk norm (Qwen3) and RoPE applied to q and k."""
        num_tokens = hidden.shape[0]
        layer = self.layer
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = q.reshape(num_tokens, layer.num_heads, layer.head_dim)  # [T, heads, head_dim]
        k = k.reshape(num_tokens, layer.num_kv_heads, layer.head_dim)  # [T, kv_heads, head_dim]
        v = v.reshape(num_tokens, layer.num_kv_heads, layer.head_dim)  # [T, kv_heads, head_dim]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if (ops := self.slot.ops(q)) is not None:
            q, k = ops.rope(q, k, cos, sin)
            return q, k, v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: Any,
    ) -> torch.Tensor:
        """Write k, v into the paged cache and attend: -> [T, heads, head_dim]."""
        return self.backend.forward(self.layer, q, k, v, kv_cache, metadata)


class DecoderMLP(nn.Module):
    def __init__(
        self, config: DecoderConfig, dtype: torch.dtype, slot: _LayerOpsSlot, tp_size: int
    ) -> None:
        super().__init__()
        self.slot = slot
        self.intermediate_size = config.intermediate_size // tp_size  # this rank's share
        self.gate_up_proj: nn.Module = nn.Linear(
            config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias, dtype=dtype
        )
        self.down_proj = nn.Linear(
            self.intermediate_size, config.hidden_size, bias=config.mlp_bias, dtype=dtype
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, hidden_size] -> [T, hidden_size]."""
        if (ops := self.slot.ops(hidden)) is not None:
            return self.down_proj(ops.gate_up_silu(self.gate_up_proj, hidden))
        gate_up = self.gate_up_proj(hidden)  # [T, 2 * intermediate_size]: gate, then up
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: DecoderConfig,
        layer: AttentionLayer,
        backend: AttentionBackend,
        dtype: torch.dtype,
        slot: _LayerOpsSlot,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.slot = slot
        self.tp = tp
        """With tensor parallelism, o_proj and down_proj hold a share of their input columns:
        their outputs are summed over the ranks."""
        tp_size = 1 if tp is None else tp.size
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, slot)
        self.self_attn = DecoderAttention(config, layer, backend, dtype, slot)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, slot)
        self.mlp = DecoderMLP(config, dtype, slot, tp_size)

    def attention_input(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual stream [T, hidden_size] -> this layer's q, k, v (see ``project``)."""
        return self.self_attn.project(self.input_layernorm(hidden), cos, sin)

    def finish(self, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """Residual stream [T, hidden_size] and attention output [T, heads, head_dim] ->
        the residual stream after this layer (o_proj, residual, MLP, residual)."""
        # attention: [T, heads, head_dim] -> [T, heads * head_dim]
        delta = self.self_attn.o_proj(attention.reshape(hidden.shape[0], -1))
        if self.tp is not None:
            delta = all_reduce(delta, self.tp)
        norm = self.post_attention_layernorm
        if (ops := self.slot.ops(hidden)) is not None:
            hidden, normed = ops.add_rms_norm(hidden, delta, norm.weight, norm.eps)
        else:
            hidden = hidden + delta
            normed = norm(hidden)
        mlp = self.mlp(normed)
        return hidden + (mlp if self.tp is None else all_reduce(mlp, self.tp))

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: Any,
    ) -> torch.Tensor:
        """hidden: [T, hidden_size] -> [T, hidden_size] (pre-norm residual block)."""
        q, k, v = self.attention_input(hidden, cos, sin)
        return self.finish(hidden, self.self_attn.attend(q, k, v, kv_cache, metadata))


class DecoderForCausalLM(nn.Module):
    """A ``CausalLM``: token ids and positions in, hidden states out; logits on request. It
    splits at attention (``SplitCausalLM``), takes an executor's fused small operations
    (``AcceptsLayerOps``) and describes its layers as data (``ProvidesDecoderWeights``).

    Build it on the meta device and give it memory (``architectures.allocate``); then call
    :meth:`initialize_rope` (the cos/sin cache is computed, not loaded).

    With ``tp`` (tensor parallelism, ``brigade.plugins.models.parallel``) this is one rank's
    shard: its attention heads, KV heads, MLP columns and vocabulary rows; the layers sum
    partial results over the ranks and :meth:`compute_logits` returns the full logits on
    rank 0. ``attention_layers`` describe this rank's heads (its KV pool's shape).
    """

    def __init__(
        self,
        config: DecoderConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.tp = tp if tp is not None and tp.size > 1 else None
        """This rank's place in a tensor-parallel group; None when the model is whole."""
        tp_size = 1 if self.tp is None else self.tp.size
        _, num_kv_heads = (
            (0, config.num_kv_heads) if self.tp is None else self.tp.kv_heads(config.num_kv_heads)
        )
        self.vocab_rows = -(-config.vocab_size // tp_size)
        """Rows of the embedding and the LM head here (the vocabulary padded to tp_size)."""
        self.layer_ops = _LayerOpsSlot()
        """The fused small operations the executor handed over (:meth:`use_layer_ops`)."""
        self.attention_layers: Sequence[AttentionLayer] = tuple(
            AttentionLayer(
                layer_index=index,
                num_heads=config.num_heads // tp_size,
                num_kv_heads=num_kv_heads,
                head_dim=config.head_dim,
                scale=config.head_dim**-0.5,
                sliding_window=window,
            )
            for index, window in enumerate(config.sliding_windows)
        )
        # _weight skips the random init: weights are loaded anyway, and normal_ on the meta
        # device would import torch._dynamo (~2.5 s of start-up).
        self.embed_tokens = nn.Embedding(
            self.vocab_rows,
            config.hidden_size,
            _weight=torch.empty(self.vocab_rows, config.hidden_size, dtype=dtype),
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer, backend, dtype, self.layer_ops, self.tp)
            for layer in self.attention_layers
        )
        self.decoder_layers = cast("tuple[DecoderLayer, ...]", tuple(self.layers))
        """The modules of ``layers``, typed (the ModuleList is what registers them)."""
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, self.layer_ops)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, self.vocab_rows, bias=False, dtype=dtype)
        )
        half = config.head_dim // 2
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", torch.empty(config.rope.max_positions, half), False)
        self.register_buffer("rope_sin", torch.empty(config.rope.max_positions, half), False)

    def initialize_rope(self) -> None:
        """Fill the float32 cos/sin caches [max_positions, head_dim // 2] on the model's device."""
        cos, sin = rope_cos_sin(self.config.rope, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Any,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden_size]."""
        hidden, cos, sin = self.embed(input_ids, positions)
        for layer, kv_cache in zip(self.decoder_layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, attn_metadata)
        return self.final_norm(hidden)

    def use_layer_ops(self, provider: LayerOpsProvider | None) -> None:
        """Run the small operations through ``provider``'s fused ones (``AcceptsLayerOps``;
        None: torch's)."""
        self.layer_ops.provider = provider

    def decoder_weights(self) -> DecoderWeights:
        """The layers as data, with the modules as they are now (``ProvidesDecoderWeights``)."""
        layers = tuple(
            DecoderLayerWeights(
                input_norm=layer.input_layernorm.weight,
                qkv_proj=layer.self_attn.qkv_proj,
                o_proj=layer.self_attn.o_proj,
                post_attention_norm=layer.post_attention_layernorm.weight,
                gate_up_proj=layer.mlp.gate_up_proj,
                down_proj=layer.mlp.down_proj,
                attention=layer.self_attn.layer,
                backend=layer.self_attn.backend,
                qk_norm=layer.self_attn.q_norm is not None,
            )
            for layer in self.decoder_layers
        )
        return DecoderWeights(
            layers=layers,
            rms_norm_eps=self.config.rms_norm_eps,
            intermediate_size=self.config.intermediate_size
            // (1 if self.tp is None else self.tp.size),
        )

    # The pieces of ``forward``, split at attention (piecewise CUDA graphs call them one by one).

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, positions: [T] -> (residual stream [T, hidden_size], RoPE cos, sin
        [T, head_dim // 2] in the activation dtype)."""
        hidden = self._embed_tokens(input_ids)  # [T, hidden_size]
        # transformers rounds cos/sin to the activation dtype before rotating.
        cos = self.rope_cos[positions].to(hidden.dtype)  # [T, head_dim // 2]
        sin = self.rope_sin[positions].to(hidden.dtype)  # [T, head_dim // 2]
        return hidden, cos, sin

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden_size]; a vocab-parallel rank looks up the ids in its rows,
        zeros the others, and the sum over the ranks is the embedding."""
        if self.tp is None:
            return cast("torch.Tensor", self.embed_tokens(input_ids))
        local = input_ids - self.tp.rank * self.vocab_rows
        outside = (local < 0) | (local >= self.vocab_rows)
        hidden = self.embed_tokens(local.masked_fill(outside, 0))  # [T, hidden_size]
        return all_reduce(hidden.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)

    def attention_input(
        self, index: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``index``: residual stream -> q [T, heads, hd], k, v [T, kv_heads, hd]."""
        return self.decoder_layers[index].attention_input(hidden, cos, sin)

    def attend(
        self,
        index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor:
        """Layer ``index``'s attention (writes k, v into ``kv_cache``): -> [T, heads, hd]."""
        return self.decoder_layers[index].self_attn.attend(q, k, v, kv_cache, attn_metadata)

    def finish_layer(
        self, index: int, hidden: torch.Tensor, attention: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``index``: residual stream and attention output -> the next residual stream."""
        return self.decoder_layers[index].finish(hidden, attention)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden_size] -> final-normed hidden states, what ``compute_logits`` reads."""
        return self.norm(hidden)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, hidden_size] -> float32 logits [rows, vocab_size] (on rank 0 of a
        tensor-parallel group; the other ranks get their vocabulary shard)."""
        if self.lm_head is None:  # tied, before tie_lm_head
            logits = F.linear(hidden_states, self.embed_tokens.weight)
        else:
            logits = cast("torch.Tensor", self.lm_head(hidden_states))
        if self.tp is not None:
            logits = gather_vocab(logits, self.tp, self.vocab_size)
        return logits.float()

    def tie_lm_head(self) -> None:
        """Give a model with tied embeddings an ``lm_head`` module that reads the embedding's
        weight (no copy), once its weights are loaded: the model's widest GEMM then is a
        linear layer like the others, which an executor may swap (the CPU GEMMs do)."""
        if self.lm_head is not None:
            return
        with torch.device("meta"):
            head = nn.Linear(self.config.hidden_size, self.vocab_rows, bias=False)
        head.weight = self.embed_tokens.weight
        self.lm_head = head
