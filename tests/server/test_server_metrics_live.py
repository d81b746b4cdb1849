"""vLLM's metric names on a live server: every series the examples/grafana dashboard queries
has data once requests ran, with vLLM's labels; Brigade's names stay alongside with "both".
The server speculates (ngram), so speculative decoding's counters come from its engine process
too."""

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
SPECULATION = ["--set", "speculative.plugin=ngram", "--set", "speculative.max_tokens_per_step=64"]
NUM_SPECULATIVE_TOKENS = 5
"""``[speculative] num_speculative_tokens``'s default: the ``position`` labels 0..4."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = tiny_model(tmp_path_factory.mktemp("model"))
    config = tiny_server_config(
        model_dir, max_model_len=256, num_pages=200, server='metrics_names = "both"\n'
    )
    with running_server(config, tmp_path_factory.mktemp("srv"), args=SPECULATION) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        for seed in range(3):
            client.completions.create(
                model="tiny", prompt="Hello", max_tokens=6, temperature=1.0, seed=seed
            )
        # A repetitive prompt: greedy decoding of the random model falls into a loop, which
        # the n-gram proposer then drafts.
        client.completions.create(
            model="tiny", prompt=[5, 6, 7, 8, 9] * 8, max_tokens=64, temperature=0
        )
        yield base


Samples = dict[str, list[tuple[dict[str, str], float]]]
VLLM_LABELS = {"model_name": "tiny", "engine": "0"}


def samples(server: str) -> Samples:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    found: Samples = {}
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
    assert counted["length"] == 4


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


def counter(found: Samples, name: str, labels: dict[str, str]) -> float:
    """The one sample of counter ``name``, which must carry exactly ``labels``."""
    ((got, value),) = found[name]
    assert got == labels, (name, got)
    return value


def by_position(found: Samples, name: str, labels: dict[str, str]) -> list[float]:
    """Counter ``name``'s samples in ``position`` order (0, 1, ...), each with ``labels``."""
    rows = found[name]
    assert all(got == {**labels, "position": got["position"]} for got, _ in rows), rows
    per_position = {int(got["position"]): value for got, value in rows}
    return [per_position[p] for p in sorted(per_position)]


def test_speculation_counts_drafts_and_accepted_tokens_by_position(server: str) -> None:
    found = samples(server)
    counts = {}
    for prefix, labels in (("brigade:", {"model_name": "tiny"}), ("vllm:", VLLM_LABELS)):
        name = f"{prefix}spec_decode_"
        drafts = counter(found, f"{name}num_drafts_total", labels)
        draft_tokens = counter(found, f"{name}num_draft_tokens_total", labels)
        accepted = counter(found, f"{name}num_accepted_tokens_total", labels)
        accepted_by_position = by_position(
            found, f"{name}num_accepted_tokens_per_pos_total", labels
        )
        drafts_by_position = by_position(found, f"{name}num_draft_tokens_per_pos_total", labels)
        assert len(accepted_by_position) == len(drafts_by_position) == NUM_SPECULATIVE_TOKENS
        assert 0 < accepted <= draft_tokens, (accepted, draft_tokens)
        assert 0 < drafts <= draft_tokens
        assert sum(accepted_by_position) == accepted
        assert sum(drafts_by_position) == draft_tokens
        assert drafts_by_position[0] == drafts  # every drafting request-step has a first draft
        # A draft is accepted only after every draft before it in its step was.
        assert accepted_by_position == sorted(accepted_by_position, reverse=True)
        assert all(a <= d for a, d in zip(accepted_by_position, drafts_by_position, strict=True))
        counts[prefix] = (drafts, draft_tokens, accepted, accepted_by_position)
    assert counts["brigade:"] == counts["vllm:"]
