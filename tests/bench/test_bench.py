"""``brigade bench``: its statistics, its argument parsing, and end-to-end runs on the
simulated executor (a 70B shape on the virtual clock) and on a tiny real model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from simulated_helpers import LLAMA_3_70B

from brigade.bench.cli import parse_workload
from brigade.bench.report import (
    BenchError,
    RequestTiming,
    RunMetrics,
    confidence_interval,
    parse_slo,
    percentile,
    summarize_run,
    t_quantile_975,
)
from brigade.cli import main
from brigade.models.create import create_model

# -- report math ------------------------------------------------------------------------------


def test_percentiles_interpolate_linearly() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) == 0.0


def test_confidence_interval_uses_the_t_distribution() -> None:
    mean, low, high = confidence_interval([1.0, 2.0, 3.0])
    # stdev 1, n 3, t(0.975, df=2) = 4.303
    assert mean == 2.0
    assert (high - low) / 2 == pytest.approx(4.303 / 3**0.5, rel=1e-4)
    assert t_quantile_975(1) == pytest.approx(12.706)
    assert t_quantile_975(100) == pytest.approx(1.96, abs=1e-3)
    assert confidence_interval([5.0]) == (5.0, 5.0, 5.0)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    timings = [
        RequestTiming(ttft_s=0.1, e2e_s=0.1 + 9 * 0.01, output_tokens=10),  # meets both
        RequestTiming(ttft_s=0.9, e2e_s=0.9 + 9 * 0.01, output_tokens=10),  # TTFT too slow
        RequestTiming(ttft_s=0.1, e2e_s=0.1 + 9 * 0.1, output_tokens=10),  # TPOT too slow
        RequestTiming(ttft_s=0.2, e2e_s=0.2, output_tokens=1),  # no TPOT: meets
    ]
    assert timings[2].tpot_s == pytest.approx(0.1)
    metrics = summarize_run(timings, RunMetrics(2.0, 3, 0.25), parse_slo("ttft=500ms,tpot=50ms"))
    assert metrics["goodput_fraction"] == 0.5
    assert metrics["request_throughput"] == 2.0
    assert metrics["output_throughput"] == 31 / 2.0
    assert metrics["preemptions"] == 3.0
    assert metrics["prefix_hit_rate"] == 0.25
    assert metrics["ttft_p50_ms"] == pytest.approx(150.0)


def test_slo_parsing() -> None:
    assert parse_slo("ttft=500ms, tpot=0.05s") == {"ttft": 0.5, "tpot": 0.05}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("latency=5ms", "METRIC one of ttft, tpot, e2e"),
        ("ttft", "METRIC=VALUE"),
        ("ttft=500", "unit, ms or s"),
        ("ttft=-1ms", "positive number"),
        ("ttft=fastms", "positive number"),
        ("", "empty"),
    ],
)
def test_bad_slos_say_what_is_allowed(spec: str, message: str) -> None:
    with pytest.raises(BenchError, match=message):
        parse_slo(spec)


def test_synthetic_workload_spec() -> None:
    spec = parse_workload("synthetic:requests=20,prompt=uniform:16:256,output=fixed:64,rate=8")
    workload = spec.build(seed=1, vocab_size=1000)
    assert len(workload) == 20
    assert all(16 <= len(r.prompt_token_ids) <= 256 for r in workload)
    assert all(r.output_len == 64 for r in workload)
    assert workload[-1].arrival_time > 0
    assert spec.build(seed=1, vocab_size=1000) == workload
    assert spec.build(seed=2, vocab_size=1000) != workload
    mixed = parse_workload("synthetic:requests=50,priorities=0:1/1:4").build(0, 1000)
    assert {r.priority for r in mixed} == {0, 1}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nonexistent.jsonl", "neither a JSONL trace file"),
        ("synthetic:prompt=fixed:8", "needs requests=N"),
        ("synthetic:requests=0", "need >= 1"),
        ("synthetic:requests=x", "must be numbers"),
        ("synthetic:requests=4,colour=red", "keys: requests"),
        ("synthetic:requests=4,prompt=zipf:3", "fixed:N, uniform:LOW:HIGH"),
        ("synthetic:requests=4,prompt=uniform:9:3", "LOW <= HIGH"),
        ("synthetic:requests=4,rate=-2", "rate=-2.0 is not allowed"),
        ("synthetic:requests=4,priorities=0:1/1", "LEVEL:WEIGHT pairs"),
        ("synthetic:requests=4,priorities=0:0", "weights > 0"),
    ],
)
def test_bad_workload_specs_say_what_is_allowed(spec: str, message: str) -> None:
    with pytest.raises(BenchError, match=message):
        parse_workload(spec)


def test_a_trace_workload_replays_its_file(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_time": 0.5, "prompt_len": 7, "output_len": 3}\n')
    (request,) = parse_workload(str(trace)).build(seed=0, vocab_size=100)
    assert (request.arrival_time, len(request.prompt_token_ids), request.output_len) == (0.5, 7, 3)


# -- end to end -------------------------------------------------------------------------------


def test_bench_compares_fcfs_and_priority_on_a_simulated_70b(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "llama-3-70b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA_3_70B), encoding="utf-8")
    configs = []
    for scheduler in ("fcfs", "priority"):
        config = tmp_path / f"{scheduler}.toml"
        config.write_text(
            f'[model]\npath = "{model_dir}"\nmax_model_len = 4096\n'
            '[executor]\nplugin = "simulated"\ngpu = "H100"\nnum_gpus = 4\n'
            f'[kv]\nmax_memory_gib = 100\n[scheduler]\nplugin = "{scheduler}"\n'
        )
        configs += ["--config", str(config)]
    out = tmp_path / "bench.json"
    workload = (
        "synthetic:requests=60,prompt=uniform:64:512,output=fixed:32,rate=20,priorities=0:1/1:4"
    )
    argv = ["bench", *configs, "--workload", workload, "--seeds", "2", "--json", str(out)]
    # Four sequences at a time serve fewer than the 20 requests/s arriving: a queue builds up.
    argv += ["--set", "scheduler.max_num_seqs=4"]
    assert main([*argv, "--slo", "ttft=500ms,tpot=50ms"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0] == "| metric | fcfs | priority |"
    assert "| goodput_fraction |" in table
    assert "| ttft_p50_ms[priority=0] |" in table
    assert "| itl_p99_ms |" in table
    result = json.loads(out.read_text())
    assert set(result["configs"]) == {"fcfs", "priority"}
    fcfs, ranked = (result["configs"][name]["metrics"] for name in ("fcfs", "priority"))
    # What the priority policy buys: level 0 reaches its first token sooner.
    high = "ttft_p50_ms[priority=0]"
    assert ranked[high]["mean"] < fcfs[high]["mean"]
    for name in ("fcfs", "priority"):
        ttft = result["configs"][name]["metrics"]["ttft_p50_ms"]
        assert len(ttft["samples"]) == 2
        assert ttft["ci95"][0] <= ttft["mean"] <= ttft["ci95"][1]
        throughput = result["configs"][name]["metrics"]["output_throughput"]["mean"]
        assert throughput > 0


def test_bench_runs_a_real_executor_on_the_wall_clock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = create_model(tmp_path / "tiny", "llama", overrides={"num_hidden_layers": 2})
    config = tmp_path / "tiny.toml"
    config.write_text(f'[model]\npath = "{model_dir}"\n[kv]\npage_size = 8\nnum_pages = 128\n')
    out = tmp_path / "bench.json"
    workload = "synthetic:requests=8,prompt=uniform:4:24,output=fixed:6,rate=200"
    argv = ["bench", "--config", str(config), "--workload", workload, "--json", str(out)]
    assert main(argv) == 0
    assert "| tiny |" in capsys.readouterr().out
    metrics = json.loads(out.read_text())["configs"]["tiny"]["metrics"]
    assert metrics["request_throughput"]["mean"] > 0
    assert 0 < metrics["ttft_p50_ms"]["mean"] <= metrics["e2e_p50_ms"]["mean"]
    assert metrics["output_tokens"]["mean"] == 8 * 6
    # Five gaps per request, each one engine step: positive, and no longer than a request.
    assert 0 < metrics["itl_p50_ms"]["mean"] <= metrics["itl_p99_ms"]["mean"]
    assert metrics["itl_p99_ms"]["mean"] < metrics["e2e_p99_ms"]["mean"]


def test_bench_reports_speculations_acceptance_beside_a_config_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = create_model(tmp_path / "tiny", "llama", overrides={"num_hidden_layers": 2})
    base = f'[model]\npath = "{model_dir}"\n[kv]\npage_size = 8\nnum_pages = 128\n'
    (tmp_path / "off.toml").write_text(base)
    (tmp_path / "ngram.toml").write_text(
        base + '[speculative]\nplugin = "ngram"\nmax_tokens_per_step = 64\n'
    )
    # Repetitive prompts: greedy decoding of the random model falls into loops that the
    # n-gram proposer drafts.
    trace = tmp_path / "w.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"arrival_time": 0.0, "prompt_token_ids": pattern * 8, "output_len": 48})
            + "\n"
            for pattern in ([5, 6, 7, 8, 9], [11, 12, 13], [5, 6, 7, 8, 9])
        )
    )
    out = tmp_path / "bench.json"
    configs = [arg for name in ("off", "ngram") for arg in ("--config", f"{tmp_path}/{name}.toml")]
    assert main(["bench", *configs, "--workload", str(trace), "--json", str(out)]) == 0
    rows = {
        cells[0]: cells[1:]
        for line in capsys.readouterr().out.splitlines()
        if (cells := [cell.strip() for cell in line.strip("|").split("|")])
    }
    assert rows["metric"] == ["off", "ngram"]
    off, ngram = (json.loads(out.read_text())["configs"][n]["metrics"] for n in ("off", "ngram"))
    assert rows["draft_acceptance_rate"][0] == rows["mean_accepted_length"][0] == "-"
    assert "draft_acceptance_rate" not in off
    assert "mean_accepted_length" not in off
    rate = ngram["draft_acceptance_rate"]["mean"]
    assert 0 < rate <= 1
    assert float(rows["draft_acceptance_rate"][1]) == pytest.approx(rate, rel=1e-3)
    # Each verifying step emits its accepted drafts and one sampled token: 1 to k + 1 (k = 5).
    assert 1 < ngram["mean_accepted_length"]["mean"] <= 6
    assert off["output_tokens"]["mean"] == ngram["output_tokens"]["mean"] == 3 * 48


def test_bench_errors_are_one_line_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--config", "x.toml", "--workload", "synthetic:requests=1", "--slo", "p=1"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("brigade: error: SLO term 'p=1'")


def test_bench_on_the_default_model_builds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BRIGADE_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "default.toml"
    config.write_text("[kv]\nnum_pages = 64\n")
    spec = "synthetic:requests=3,prompt=fixed:8,output=fixed:4"
    assert main(["bench", "--config", str(config), "--workload", spec]) == 0
    assert "| output_throughput |" in capsys.readouterr().out
