"""docs/config.md is generated from the option schemas and must not go stale."""

from __future__ import annotations

from pathlib import Path

from brigade.config_docs import render_config_reference
from brigade.registry import load_registry
from brigade.stations import STATIONS

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_config_reference_is_up_to_date() -> None:
    expected = render_config_reference(load_registry(), distribution_prefix="brigade-llm ")
    assert DOC.read_text(encoding="utf-8") == expected, (
        "docs/config.md is stale: run `brigade config docs > docs/config.md`"
    )


def test_reference_names_every_station_and_builtin_option() -> None:
    text = render_config_reference(load_registry(), distribution_prefix="brigade-llm ")
    for name in STATIONS:
        assert f"## `[{name}]`" in text
    for key in ("page_size", "max_num_batched_tokens", "api_keys", "device", "num_threads"):
        assert f"`{key}`" in text
