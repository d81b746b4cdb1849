"""A :class:`SamplingBatch` built the way core builds one, for sampler and processor checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from brigade.interfaces import SamplingBatch

__all__ = ["make_sampling_batch"]


def make_sampling_batch(
    num_rows: int,
    *,
    temperature: float | Sequence[float] = 1.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    min_p: float | Sequence[float] = 0.0,
    seeds: Mapping[int, int] | None = None,
    generators: Mapping[int, torch.Generator] | None = None,
    rows: Sequence[int] | None = None,
    max_num_logprobs: int | None = None,
    device: str | torch.device = "cpu",
) -> SamplingBatch:
    """A :class:`SamplingBatch` of ``num_rows`` rows, with the flags core would compute.

    Scalars apply to every row. ``seeds`` maps a sampled-row index to a seed: that row gets a
    fresh ``torch.Generator(device).manual_seed(seed)``; ``generators`` passes existing ones
    (a request's generator lives across steps). ``rows`` defaults to ``0..num_rows-1``.
    """

    def per_row(value: Any, dtype: torch.dtype) -> torch.Tensor:
        values = list(value) if isinstance(value, Sequence) else [value] * num_rows
        if len(values) != num_rows:
            raise ValueError(f"{len(values)} per-row values for {num_rows} rows")
        return torch.tensor(values, dtype=dtype, device=device)

    temperatures = per_row(temperature, torch.float32)
    top_ks = per_row(top_k, torch.int64)
    top_ps = per_row(top_p, torch.float32)
    min_ps = per_row(min_p, torch.float32)
    generators = dict(generators or {})
    for index, seed in (seeds or {}).items():
        generators[index] = torch.Generator(device).manual_seed(seed)
    return SamplingBatch(
        rows=per_row(range(num_rows) if rows is None else rows, torch.int64),
        temperature=temperatures,
        top_k=top_ks,
        top_p=top_ps,
        min_p=min_ps,
        generators=generators,
        all_greedy=bool((temperatures == 0).all()),
        any_top_k=bool((top_ks > 0).any()),
        any_top_p=bool((top_ps < 1).any()),
        any_min_p=bool((min_ps > 0).any()),
        max_num_logprobs=max_num_logprobs,
    )
