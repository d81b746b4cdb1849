"""Speculative decoding on the simulated executor: drafts come true with probability
``draft_acceptance`` at each position, verification rows are charged as the decode rows they
are, and a policy study sees speculation's fewer, slightly dearer steps."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
from simulated_helpers import LLAMA_3_70B, settings

from brigade.bench.simulate import SimulationResult, run_simulation
from brigade.bench.workloads import Lengths, synthetic
from brigade.config import load_config
from brigade.engine import EngineCore
from brigade.interfaces import Request, SamplingParams
from brigade.plugins.executors.simulated import GPUS, CostModel, ModelShape
from brigade.registry import Registry, load_registry

K = 4
"""Drafts per verification."""
OUTPUT_LEN = 128


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry()


def speculating(draft_acceptance: float) -> list[str]:
    """Every running request verifies K drafts every step (no adaptive length, no pause)."""
    return [
        "speculative.plugin=repeat-last",  # always drafts as many tokens as allowed
        f"speculative.num_speculative_tokens={K}",
        "speculative.adaptive=false",
        "speculative.min_acceptance_rate=0",
        "speculative.max_batch_size=64",
        "speculative.max_tokens_per_step=512",
        f"executor.draft_acceptance={draft_acceptance}",
    ]


def generate(
    model_dir: Path, registry: Registry, prompt_lens: Sequence[int], *extra: str
) -> tuple[EngineCore, list[Request]]:
    """Run prompts of ``prompt_lens`` tokens to OUTPUT_LEN tokens each on a simulated 70B."""
    overrides = ["executor.plugin=simulated", *settings(model_dir, *extra)]
    engine = EngineCore(load_config(None, registry, overrides=overrides), registry)
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    requests = [
        engine.add_request(str(i), [(31 * i + j) % 1000 for j in range(length)], params)
        for i, length in enumerate(prompt_lens)
    ]
    while engine.has_unfinished():
        engine.step()
    assert [r.num_output_tokens for r in requests] == [OUTPUT_LEN] * len(requests)
    return engine, requests


@pytest.mark.parametrize("draft_acceptance", [0.3, 0.8])
def test_each_draft_comes_true_with_probability_draft_acceptance(
    model_70b: Path, registry: Registry, draft_acceptance: float
) -> None:
    engine, _ = generate(model_70b, registry, [64] * 32, *speculating(draft_acceptance))
    stats = engine.stats().speculative
    assert stats is not None
    # Draft j + 1 is accepted when it and every draft before it came true: p^(j + 1).
    for position, (accepted, drafts) in enumerate(
        zip(stats.accepted_by_position, stats.drafts_by_position, strict=True)
    ):
        expected = draft_acceptance ** (position + 1)
        error = math.sqrt(expected * (1 - expected) / drafts)
        assert drafts > 1000
        assert abs(accepted / drafts - expected) < 4 * error, (position, accepted, drafts)
    mean_length = sum(draft_acceptance**j for j in range(K + 1))
    assert stats.mean_accepted_length == pytest.approx(mean_length, rel=0.05)


def test_drafts_that_always_or_never_come_true(model_70b: Path, registry: Registry) -> None:
    always, _ = generate(model_70b, registry, [64] * 8, *speculating(1.0))
    never, _ = generate(model_70b, registry, [64] * 8, *speculating(0.0))
    always_stats, never_stats = always.stats().speculative, never.stats().speculative
    assert always_stats is not None
    assert never_stats is not None
    assert always_stats.num_drafts > 0
    assert always_stats.acceptance_rate == 1.0
    assert never_stats.num_drafts > 0
    assert never_stats.num_accepted == 0
    # 1 + K tokens a step; one token a step (each verification emits the rejected position).
    assert always.num_steps < 0.25 * never.num_steps


def test_rows_of_other_requests_are_not_drafts(model_70b: Path, registry: Registry) -> None:
    # Prompts of consecutive lengths: neighbouring decode rows have consecutive seq_lens too,
    # but no drafts, so draft_acceptance must not change a token.
    lengths = list(range(40, 56))
    _, certain = generate(model_70b, registry, lengths, "executor.draft_acceptance=1.0")
    _, impossible = generate(model_70b, registry, lengths, "executor.draft_acceptance=0.0")
    assert [r.output_token_ids for r in certain] == [r.output_token_ids for r in impossible]


def test_the_same_seed_gives_the_same_speculation(model_70b: Path, registry: Registry) -> None:
    first, requests = generate(model_70b, registry, [64] * 8, *speculating(0.5))
    second, again = generate(model_70b, registry, [64] * 8, *speculating(0.5))
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in again]
    assert first.stats().speculative == second.stats().speculative
    assert first.executor.modelled_time_s() == second.executor.modelled_time_s()


# -- what speculation costs on the virtual clock ----------------------------------------------


def simulate(model_dir: Path, registry: Registry, *extra: str) -> SimulationResult:
    workload = synthetic(
        32, Lengths("fixed", 64), Lengths("fixed", OUTPUT_LEN), vocab_size=LLAMA_3_70B["vocab_size"]
    )
    result = run_simulation(settings(model_dir, *extra), workload, registry=registry)
    assert [r.output_len for r in result.requests] == [OUTPUT_LEN] * 32
    return result


def test_speculation_takes_fewer_slightly_dearer_steps(model_70b: Path, registry: Registry) -> None:
    plain = simulate(model_70b, registry)
    assert plain.speculative is None
    for draft_acceptance, most_steps in ((0.3, 0.9), (0.8, 0.45)):
        ours = simulate(model_70b, registry, *speculating(draft_acceptance))
        # The result carries the counters brigade bench reports (acceptance at position 1 ~ p).
        assert ours.speculative is not None
        first = ours.speculative.accepted_by_position[0] / ours.speculative.drafts_by_position[0]
        assert abs(first - draft_acceptance) < 0.05, first
        # 1 + p + ... + p^K tokens per verification (1.43 and 3.36) instead of one.
        assert ours.num_steps < most_steps * plain.num_steps, (draft_acceptance, ours.num_steps)
        # Each step verifies 32 x (1 + K) rows instead of 32: charged (more KV reads,
        # all-reduces, LM head) but far below 5x, as 32 x 5 decode rows of a 70B model on
        # 4 H100s stay bandwidth-bound and the weights are read once.
        step_s, plain_step_s = ours.duration_s / ours.num_steps, plain.duration_s / plain.num_steps
        assert 1.05 * plain_step_s < step_s < 1.5 * plain_step_s, (step_s, plain_step_s)
        assert ours.duration_s < plain.duration_s


def test_verification_rows_are_nearly_free_until_compute_bound() -> None:
    shape = ModelShape.from_hf_config(LLAMA_3_70B)
    model = CostModel(shape, GPUS["H100"], efficiency=1.0, step_overhead_s=0.0)

    def verifying(batch: int, drafts: int, context: int = 512) -> float:
        """A step where ``batch`` requests each verify ``drafts`` drafts (1 + drafts rows)."""
        rows = 1 + drafts
        seq_lens = [context + offset for _ in range(batch) for offset in range(rows)]
        return model.step_time([1] * (batch * rows), seq_lens, batch * rows)

    # Batch 1: bandwidth-bound; 5 rows read the weights once, like 1.
    assert verifying(1, K) < 1.05 * verifying(1, 0)
    # Batch 256: 1280 rows are compute-bound; verification costs about its FLOPs.
    assert verifying(256, K) > 3 * verifying(256, 0)


# -- a draft model on the simulator ------------------------------------------------------------

LLAMA_3_2_1B = {
    **LLAMA_3_70B,
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
}
"""A draft for the 70B: Llama-3.2-1B's shape, the same vocabulary."""


@pytest.fixture(scope="module")
def model_1b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama-3.2-1b")
    (directory / "config.json").write_text(json.dumps(LLAMA_3_2_1B), encoding="utf-8")
    return directory


def test_a_draft_models_passes_count_on_the_virtual_clock(
    model_70b: Path, model_1b: Path, registry: Registry
) -> None:
    """The draft-model proposer runs a simulated 1B beside the simulated 70B: its K passes
    per step are charged to the engine's clock, so it takes as many steps as drafts that
    come true as often, and longer."""
    drafting = [
        *speculating(0.7),
        "speculative.plugin=draft-model",
        f"speculative.model={model_1b}",
    ]
    engine, _ = generate(model_70b, registry, [64] * 8, *drafting)
    (draft,) = engine.draft_executors
    assert draft.modelled_time_s() > 0
    assert engine.modelled_time_s() == engine.executor.modelled_time_s() + draft.modelled_time_s()
    stats = engine.stats().speculative
    assert stats is not None
    first = stats.accepted_by_position[0] / stats.drafts_by_position[0]
    assert abs(first - 0.7) < 0.05, first

    free = simulate(model_70b, registry, *speculating(0.7))
    paid = simulate(model_70b, registry, *drafting)
    assert paid.num_steps == pytest.approx(free.num_steps, rel=0.1)
    # K passes of a 1B model on the same 4 H100s per step: a visible share of a 70B step.
    per_step = (paid.duration_s - free.duration_s) / paid.num_steps
    assert 0.1 * free.duration_s / free.num_steps < per_step < free.duration_s / free.num_steps
