"""The plugins a station gets when its table names none, on this machine: on a CUDA GPU the
measured fast path (the ``cuda-graph`` executor, ``triton`` attention), elsewhere each station's
static default.

On an H200 the eager ``torch`` executor decoded 61-76 tokens/s at batch 1 and ``cuda-graph``
with ``triton`` 929 (docs/gpu.md), so a GPU user gets graphs and Triton with no flags, as vLLM
users do; ``[executor] plugin = "torch"`` (``--enforce-eager``) or any named plugin keeps
theirs. A table holding keys the GPU plugin does not take (``tensor_parallel_size``, an option
of ``sdpa``) keeps the static default, whose options those are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from brigade.errors import UnknownComponentError
from brigade.plugins.attention.triton_backend import triton_runs_on
from brigade.registry import Registry
from brigade.stations import STATIONS

__all__ = ["GPU_PLUGINS", "machine_defaults"]

GPU_PLUGINS = {"executor": "cuda-graph", "attention": "triton"}
"""Station -> the plugin it gets on a CUDA GPU when its table names none."""

_EAGER_EXECUTORS = ("torch", "cuda-graph")
"""Executors whose ``device`` option says where the model runs."""


def machine_defaults(tables: Mapping[str, Mapping[str, Any]], registry: Registry) -> dict[str, str]:
    """Station -> plugin for the stations that have a faster default on this machine (taken
    where the table names no plugin); empty off a CUDA GPU."""
    executor = tables.get("executor", {})
    if executor.get("plugin", "torch") not in _EAGER_EXECUTORS:
        return {}  # simulated, or a third party's: it knows its device
    device = str(executor.get("device", "auto"))
    if not (device == "auto" or device.startswith("cuda")) or not torch.cuda.is_available():
        return {}
    chosen = {}
    for station, plugin in GPU_PLUGINS.items():
        table = tables.get(station, {})
        if _takes(registry, station, plugin, table):
            chosen[station] = plugin
    if "attention" in chosen and not triton_runs_on(
        torch.device("cuda" if device == "auto" else device).index
    ):
        del chosen["attention"]
    return chosen


def _takes(registry: Registry, station: str, plugin: str, table: Mapping[str, Any]) -> bool:
    """Whether ``plugin`` is installed and its options take every plugin key of ``table`` (its
    values are checked when the station is built, with that plugin's messages)."""
    try:
        options_type = registry.get(STATIONS[station].kind or "", plugin).options_type
    except UnknownComponentError:
        return False
    settings = {f.name for f in dataclasses.fields(STATIONS[station].settings_type)}
    taken = {f.name for f in dataclasses.fields(options_type)}
    return all(key in settings or key in taken for key in table if key != "plugin")
