"""``brigade generate --data-parallel-size``: prompts placed by the router on replica
processes, the answers those of one engine, in prompt order."""

from __future__ import annotations

from pathlib import Path

from brigade import SamplingParams
from brigade.config import load_config
from brigade.offline_replicas import generate_on_replicas, place_prompts
from brigade.registry import default_registry
from tests.engine_helpers import assert_replicas_answer_as_one_engine
from tests.server_harness import tiny_model

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
HEADS = ("You are a terse assistant. Answer in one word. ", "Translate to French: ")
PROMPTS = [head + tail for tail in ("cat", "dog", "bird") for head in HEADS]


def test_cache_aware_placement_keeps_a_shared_head_on_one_replica() -> None:
    registry = default_registry()
    overrides = ["router.plugin=cache-aware", "router.data_parallel_size=2", "kv.page_size=8"]
    config = load_config(None, registry, overrides=overrides)
    placed = place_prompts(config, registry, PROMPTS, 2)
    by_head = {
        head: {placed[i] for i, p in enumerate(PROMPTS) if p.startswith(head)} for head in HEADS
    }
    assert all(len(replicas) == 1 for replicas in by_head.values()), by_head
    assert set(placed) == {0, 1}, f"both heads went to one replica: {placed}"


def test_replica_processes_answer_as_one_engine(tmp_path: Path) -> None:
    model_dir = tiny_model(tmp_path)
    settings = [f"model.path={model_dir}", "kv.page_size=8", "kv.num_pages=128"]
    results = generate_on_replicas(
        None,
        [*settings, "router.data_parallel_size=2", "router.plugin=cache-aware"],
        PROMPTS,
        GREEDY,
    )
    assert sorted(r.replica for r in results) == [0, 1]
    assert_replicas_answer_as_one_engine(results, settings, PROMPTS, GREEDY)
    assert sorted(len(r.indices) for r in results) == [3, 3], "one head per replica"
