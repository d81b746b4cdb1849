"""The entry point Brigade loads (``[project.entry-points.brigade]`` in pyproject.toml)."""

from __future__ import annotations

from brigade.interfaces import ComponentRegistry, hookimpl

from brigade_example_stations.attention import GatherSdpaBackend
from brigade_example_stations.repeat_last_n import RepeatLastNOptions, RepeatLastNProcessor
from brigade_example_stations.sampler import PlainTorchSampler

API_VERSION = "2.4"
"""The ``brigade.interfaces.API_VERSION`` this plugin was written against (2.4: rollback and
``is_position_independent`` of logits processors)."""


@hookimpl
def brigade_register(registry: ComponentRegistry) -> None:
    """Register ``[sampler] plugin = "plain-torch"``, ``[sampler] logits_processors =
    ["repeat-last-n"]`` and ``[attention] plugin = "gather-sdpa"``."""
    registry.add("sampler", "plain-torch", PlainTorchSampler, api_version=API_VERSION)
    registry.add(
        "logits_processor",
        "repeat-last-n",
        RepeatLastNProcessor,
        options=RepeatLastNOptions,
        api_version=API_VERSION,
    )
    registry.add("attention", "gather-sdpa", GatherSdpaBackend, api_version=API_VERSION)
