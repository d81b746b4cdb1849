"""The plugins a station gets when its table names none, on this machine: each station's
measured fast path here, else its static default.

On a CUDA GPU that is the ``cuda-graph`` executor and ``triton`` attention: on an H200 the
eager ``torch`` executor decoded 61-76 tokens/s at batch 1 and ``cuda-graph`` with ``triton``
929 (docs/gpu.md), so a GPU user gets graphs and Triton with no flags, as vLLM users do. Where
the model runs on a CPU (the ``torch`` executor on device ``cpu``, or ``auto`` without CUDA)
attention is the ``cpu`` backend (Brigade's C++ kernels over the pages in place; the static
default ``sdpa`` is the pure-torch reference). ``[executor] plugin = "torch"``
(``--enforce-eager``) or any named plugin keeps theirs. A table holding keys the faster plugin
does not take (``tensor_parallel_size`` on a GPU) keeps the static default, whose options those
are; on a GPU an attention table of the ``cpu`` backend's options keeps that backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from brigade.errors import UnknownComponentError
from brigade.plugins.gpu import triton_runs_on
from brigade.registry import Registry
from brigade.stations import STATIONS

__all__ = ["CPU_PLUGINS", "GPU_PLUGINS", "machine_defaults"]

GPU_PLUGINS = {"executor": "cuda-graph", "attention": "triton"}
"""Station -> the plugin it gets on a CUDA GPU when its table names none."""
CPU_PLUGINS = {"attention": "cpu"}
"""Station -> the plugin it gets when the model runs on a CPU and its table names none."""

_EAGER_EXECUTORS = ("torch", "cuda-graph")
"""Executors whose ``device`` option says where the model runs."""


def machine_defaults(tables: Mapping[str, Mapping[str, Any]], registry: Registry) -> dict[str, str]:
    """Station -> plugin for the stations that have a faster default on this machine (taken
    where the table names no plugin): :data:`GPU_PLUGINS` where the model runs on a CUDA GPU,
    :data:`CPU_PLUGINS` where it runs on a CPU, each where its options take the table's keys."""
    executor = tables.get("executor", {})
    if executor.get("plugin", "torch") not in _EAGER_EXECUTORS:
        return {}  # simulated, or a third party's: it knows its device
    device = str(executor.get("device", "auto"))
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return _fitting(CPU_PLUGINS, tables, registry)
    if not torch.cuda.is_available():
        return {}  # a CUDA device named where there is none: the executor says so
    chosen = _fitting(GPU_PLUGINS, tables, registry)
    if "attention" in chosen and not triton_runs_on(
        torch.device("cuda" if device == "auto" else device).index
    ):
        del chosen["attention"]
    if "attention" not in chosen and tables.get("attention"):
        # Options of the cpu backend's (vLLM's --disable-cascade-attn sets cascade_decode)
        # keep it: off a CPU its kernels stay off and it attends as sdpa does.
        chosen.update(_fitting(CPU_PLUGINS, tables, registry))
    return chosen


def _fitting(
    plugins: Mapping[str, str], tables: Mapping[str, Mapping[str, Any]], registry: Registry
) -> dict[str, str]:
    """The entries of ``plugins`` (station -> plugin) whose plugin takes its station's table."""
    return {
        station: plugin
        for station, plugin in plugins.items()
        if _takes(registry, station, plugin, tables.get(station, {}))
    }


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
