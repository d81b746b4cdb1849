"""The simulated executor: its cost model, and that driving the real scheduler and KV manager
through it reproduces known qualitative results at a 70B scale on a CPU."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from simulated_helpers import LLAMA_3_70B, settings

from brigade.bench.simulate import run_simulation
from brigade.bench.workloads import Arrivals, Lengths, shared_prefix, synthetic
from brigade.errors import ConfigError
from brigade.plugins.executors.simulated import GPUS, CostModel, ModelShape, StepProfile

SHAPE_70B = ModelShape.from_hf_config(LLAMA_3_70B)


# -- the cost model ---------------------------------------------------------------------------


def ideal(gpu: str = "H100") -> CostModel:
    return CostModel(SHAPE_70B, GPUS[gpu], efficiency=1.0, step_overhead_s=0.0)


def test_the_70b_shape_has_70_billion_parameters() -> None:
    assert 70.0e9 < SHAPE_70B.num_params < 71.0e9
    assert SHAPE_70B.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2


def test_decode_at_batch_one_is_bandwidth_bound() -> None:
    model = ideal()
    weights = (SHAPE_70B.layer_params + SHAPE_70B.vocab_size * SHAPE_70B.hidden_size) * 2
    step = model.step_time([1], [128], num_sampled=1)
    assert step == pytest.approx(weights / GPUS["H100"].bandwidth, rel=0.01)
    assert model.memory_s([1], [128]) > 100 * model.compute_s([1], [128], 1)
    # More bandwidth, faster decode; same FLOP/s does not matter.
    assert ideal("H200").step_time([1], [128], 1) < 0.75 * step


def test_prefill_is_compute_bound() -> None:
    model = ideal()
    step = model.step_time([4096], [4096], num_sampled=1)
    assert model.compute_s([4096], [4096], 1) > 5 * model.memory_s([4096], [4096])
    flops = 2 * SHAPE_70B.layer_params * 4096
    assert step == pytest.approx(flops / GPUS["H100"].peak_flops, rel=0.1)
    assert ideal("A100").step_time([4096], [4096], 1) > 3 * step


def test_decode_grows_with_batch_and_context_through_kv_reads() -> None:
    model = ideal()
    small = model.step_time([1] * 64, [512] * 64, 64)
    long_context = model.step_time([1] * 64, [4096] * 64, 64)
    assert model.step_time([1], [512], 1) < small < long_context


def test_overhead_and_efficiency_scale_the_step() -> None:
    base = ideal().step_time([1], [128], 1)
    slower = CostModel(SHAPE_70B, GPUS["H100"], efficiency=0.5, step_overhead_s=0.002)
    assert slower.step_time([1], [128], 1) == pytest.approx(2 * base + 0.002)


def test_tensor_parallel_adds_two_all_reduces_per_layer() -> None:
    one = ideal()
    assert one.communication_s(4096) == 0.0
    four = CostModel(SHAPE_70B, GPUS["H100"], num_gpus=4, efficiency=1.0, step_overhead_s=0.0)
    # A ring all-reduce of T x hidden bf16 activations: each GPU sends 2 (n - 1) / n of them.
    tokens = 4096
    sent = 2 * 3 / 4 * tokens * SHAPE_70B.hidden_size * 2
    per_reduce = GPUS["H100"].link_latency_s + sent / GPUS["H100"].link_bandwidth
    assert four.communication_s(tokens) == pytest.approx(2 * 80 * per_reduce)
    # Not overlapped: the step is the ideal 4-GPU step plus the all-reduces.
    ideal_four = max(four.compute_s([tokens], [tokens], 1), four.memory_s([tokens], [tokens]))
    step = four.step_time([tokens], [tokens], 1)
    assert step == pytest.approx(ideal_four + four.communication_s(tokens))
    # Prefill: still ~3.5x faster than one GPU; batch-1 decode pays mostly the latencies.
    assert 3.0 < one.step_time([tokens], [tokens], 1) / step < 4.0
    decode = four.step_time([1], [128], 1)
    assert four.communication_s(1) == pytest.approx(2 * 80 * 10e-6, rel=0.01)
    assert one.step_time([1], [128], 1) / decode < 4.0


def test_a_profile_replaces_the_analytic_model(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps({"prefill_tokens_per_s": 10000, "decode_step_s_at": {"1": 0.02, "65": 0.04}})
    )
    model = CostModel(SHAPE_70B, GPUS["H100"], profile=StepProfile.load(path))
    assert model.step_time([1], [100], 1) == pytest.approx(0.02)
    assert model.step_time([1] * 33, [100] * 33, 33) == pytest.approx(0.03)
    # A mixed step: the decodes' time plus the prefill tokens at the measured rate.
    assert model.step_time([1, 1000], [100, 1000], 2) == pytest.approx(0.0200025 + 0.1, rel=1e-3)


def test_a_bad_profile_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"prefill_tokens_per_s": 10000}))
    with pytest.raises(ConfigError, match="decode_step_s_at"):
        StepProfile.load(path)


def test_weights_that_do_not_fit_are_a_config_error(model_70b: Path) -> None:
    workload = synthetic(1, Lengths("fixed", 8), Lengths("fixed", 2))
    with pytest.raises(ConfigError, match="raise num_gpus"):
        run_simulation([f"model.path={model_70b}", "executor.gpu=A100"], workload)


# -- the engine on the virtual clock ----------------------------------------------------------


def test_ten_thousand_requests_on_a_70b_model(model_70b: Path) -> None:
    """Measured: about 15-20 s of wall time on the development machine (16 cores)."""
    workload = synthetic(
        10_000,
        Lengths("lognormal", 512, 0.6, maximum=3000),
        Lengths("lognormal", 128, 0.6, maximum=1000),
        Arrivals("poisson", rate=40.0),
        vocab_size=LLAMA_3_70B["vocab_size"],
    )
    result = run_simulation(
        settings(
            model_70b,
            "scheduler.max_num_seqs=256",
            "scheduler.max_num_batched_tokens=8192",
        ),
        workload,
    )
    assert len(result.requests) == 10_000
    assert [r.output_len for r in result.requests] == [w.output_len for w in workload]
    assert all(0 < r.ttft_s <= r.e2e_s for r in result.requests)
    # Virtual time, not wall time: the run covers at least the arrival span.
    assert result.duration_s >= workload[-1].arrival_time
    assert result.output_throughput > 0


def test_prefix_caching_raises_throughput_on_shared_prefixes(model_70b: Path) -> None:
    workload = shared_prefix(
        num_groups=4,
        requests_per_group=64,
        prefix_len=2048,
        suffix_lens=Lengths("uniform", 64, 32),
        output_lens=Lengths("fixed", 32),
        vocab_size=LLAMA_3_70B["vocab_size"],
    )
    cached = run_simulation(settings(model_70b, "kv.enable_prefix_caching=true"), workload)
    uncached = run_simulation(settings(model_70b, "kv.enable_prefix_caching=false"), workload)
    assert cached.prefix_hit_rate > 0.8
    assert uncached.prefix_hit_rate == 0.0
    assert cached.request_throughput > 2 * uncached.request_throughput


def test_priority_scheduling_lowers_high_priority_ttft(model_70b: Path) -> None:
    # Arrivals faster than the engine serves them, so a queue builds up.
    workload = synthetic(
        400,
        Lengths("normal", 1024, 256, maximum=2048),
        Lengths("normal", 128, 32),
        Arrivals("poisson", rate=30.0),
        vocab_size=LLAMA_3_70B["vocab_size"],
        priorities=((0, 0.2), (1, 0.8)),
        seed=3,
    )
    limits = ("scheduler.max_num_seqs=32", "scheduler.max_num_batched_tokens=4096")
    fcfs = run_simulation(settings(model_70b, *limits, "scheduler.plugin=fcfs"), workload)
    ranked = run_simulation(settings(model_70b, *limits, "scheduler.plugin=priority"), workload)
    assert ranked.mean_ttft_s(priority=0) < 0.5 * fcfs.mean_ttft_s(priority=0)
    assert ranked.mean_ttft_s(priority=1) > ranked.mean_ttft_s(priority=0)


def test_the_same_seed_gives_the_same_result(model_70b: Path) -> None:
    workload = synthetic(
        50, Lengths("fixed", 100), Lengths("uniform", 20, 10), Arrivals("gamma", 20.0, 0.5)
    )
    first = run_simulation(settings(model_70b), workload)
    second = run_simulation(settings(model_70b), workload)
    assert first.requests == second.requests
    assert first.duration_s == second.duration_s


def test_requests_the_engine_refuses_are_counted_not_fatal(model_70b: Path) -> None:
    workload = synthetic(
        20, Lengths("fixed", 100), Lengths("fixed", 10), Arrivals("poisson", 50.0), seed=1
    )
    too_long = dataclasses.replace(workload[7], prompt_token_ids=[5] * 5000)  # > 4096
    workload = [*workload[:7], too_long, *workload[8:]]
    result = run_simulation(settings(model_70b), workload)
    assert len(result.errors) == 1
    assert "5000 tokens" in result.errors[0]
    assert len(result.requests) == 19
    assert all(r.output_len == 10 for r in result.requests)
