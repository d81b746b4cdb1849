"""vLLM's metric names on a live server: every series the examples/grafana dashboard queries
has data once requests ran, with vLLM's labels; Brigade's names stay alongside with "both"."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import running_server, tiny_model, tiny_server_config

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "brigade-vllm-names.json"
SUFFIXES = ("_bucket", "_sum", "_count")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = tiny_model(tmp_path_factory.mktemp("model"))
    config = tiny_server_config(
        model_dir, max_model_len=256, num_pages=200, server='metrics_names = "both"\n'
    )
    with running_server(config, tmp_path_factory.mktemp("srv")) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        for seed in range(3):
            client.completions.create(
                model="tiny", prompt="Hello", max_tokens=6, temperature=1.0, seed=seed
            )
        yield base


def samples(server: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def dashboard_series() -> set[str]:
    panels = json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
    assert len(panels) == 12
    names = set()
    for panel in panels:
        for target in panel["targets"]:
            names |= set(re.findall(r"vllm:[a-z0-9_]+", target["expr"]))
    return names


def test_every_series_the_dashboard_queries_has_data_with_vllm_labels(server: str) -> None:
    found = samples(server)
    for name in sorted(dashboard_series()):
        assert name in found, f"{name}: no such series in /metrics"
        rows = [labels for labels, _ in found[name]]
        assert all(r.get("model_name") == "tiny" and r.get("engine") == "0" for r in rows), rows
        if name.endswith(("_count", "_total")):
            assert sum(v for _, v in found[name]) > 0, f"{name}: nothing counted"
    counted = {labels["finished_reason"]: v for labels, v in found["vllm:request_success_total"]}
    assert counted["length"] == 3


def test_both_namings_count_the_same_requests(server: str) -> None:
    found = samples(server)
    for name in (
        "prompt_tokens_total",
        "generation_tokens_total",
        "e2e_request_latency_seconds_count",
    ):
        ours = sum(v for _, v in found[f"brigade:{name}"])
        theirs = sum(v for _, v in found[f"vllm:{name}"])
        assert ours == theirs > 0, name
    assert all("engine" not in labels for labels, _ in found["brigade:prompt_tokens_total"])
