"""Tensor parallelism inside the decoder: which slice of each weight a rank holds, and the
collectives that put the partial results together.

The decoder keeps plain ``nn.Linear`` modules, built at their shard's shape, rather than
parallel layer classes (nano-vllm's ``ColumnParallelLinear`` and kin): the CPU GEMM packing
(``brigade.plugins.cpu.gemm``) swaps ``nn.Linear`` modules, and a sharded linear is
an ordinary one over fewer rows or columns. What a parallel layer class would own lives here
instead, as data and two functions:

- :class:`Shard` says where a checkpoint tensor's rows (column parallel: q/k/v, gate/up, the
  vocabulary of the embedding and the LM head) or columns (row parallel: o_proj, down_proj) for
  this rank start; the loader narrows the checkpoint tensor to it, and safetensors checkpoints
  read only that slice (``Checkpoint.weight_slices``).
- :func:`all_reduce` sums the row-parallel outputs (once after attention, once after the MLP,
  once after the vocab-parallel embedding); :func:`gather_vocab` puts the LM head's vocabulary
  shards side by side on rank 0.

KV heads: with at least as many KV heads as ranks each rank holds ``num_kv_heads / size`` of
them; with fewer, each KV head is replicated on ``size / num_kv_heads`` ranks (as vLLM does),
so every rank's query heads find theirs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from brigade.interfaces import ConfigError

__all__ = ["Shard", "TensorParallel", "all_reduce", "check_shardable", "gather_vocab"]

KEY = "[executor] tensor_parallel_size"


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in a tensor-parallel group.

    The group is a process group object of its own, not torch.distributed's default one:
    one process may hold the rank 0 of several groups (engines side by side, tests)."""

    rank: int
    size: int
    group: Any = dataclasses.field(default=None, compare=False)
    """The ``torch.distributed.ProcessGroup`` the collectives run in (None: only sizes are
    asked, nothing runs)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")

    def split(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's even share of ``total`` (a multiple of size)."""
        length = total // self.size
        return self.rank * length, length

    def padded_split(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's share of ``total`` rounded up to a multiple of size
        (the vocabulary); the last rank's share may run past ``total`` (padding rows)."""
        length = -(-total // self.size)
        return self.rank * length, length

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads) this rank holds: a share, or one replicated head."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """Which part of a checkpoint tensor this rank holds."""

    dim: int
    """0: rows (column parallel, vocabulary); 1: columns (row parallel)."""
    start: int
    length: int
    """May run past the tensor's end (vocabulary padding): the rest is zero."""
    zero: bool = False
    """Load zeros instead (a row-parallel bias on ranks other than 0: the all-reduce would
    otherwise add it ``size`` times)."""


def check_shardable(
    size: int, *, num_heads: int, num_kv_heads: int, intermediate_size: int
) -> None:
    """``ConfigError`` naming the key unless a model of these sizes splits over ``size`` ranks."""
    if num_heads % size:
        raise ConfigError(
            f"{KEY} = {size}: the model's {num_heads} attention heads do not split evenly; "
            f"allowed: {_divisors(num_heads)}"
        )
    if num_kv_heads % size and size % num_kv_heads:
        raise ConfigError(
            f"{KEY} = {size}: the model's {num_kv_heads} KV heads neither split evenly over "
            f"the ranks nor replicate evenly onto them; allowed: a divisor or a multiple of "
            f"{num_kv_heads} that divides {num_heads}"
        )
    if intermediate_size % size:
        raise ConfigError(
            f"{KEY} = {size}: the model's intermediate_size {intermediate_size} does not split "
            f"evenly; allowed: {_divisors(intermediate_size, limit=num_heads)}"
        )


def _divisors(value: int, limit: int | None = None) -> str:
    top = value if limit is None else min(value, limit)
    return ", ".join(str(d) for d in range(1, top + 1) if value % d == 0)


def all_reduce(partial: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum ``partial`` over the ranks, in place; returns it."""
    tp.group.allreduce([partial]).wait()
    return partial


def gather_vocab(local: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """Each rank's logits [rows, vocab shard] -> on rank 0 the full [rows, vocab_size]
    (padding columns dropped); other ranks get their input back (they sample nothing)."""
    local = local.contiguous()
    options = dist.GatherOptions()
    options.rootRank = 0
    if tp.rank != 0:
        tp.group.gather([], [local], options).wait()
        return local
    shards = [torch.empty_like(local) for _ in range(tp.size)]
    tp.group.gather([shards], [local], options).wait()
    return torch.cat(shards, dim=-1)[:, :vocab_size]  # [rows, padded vocab] -> [rows, vocab]
