"""``brigade bench``: the extended workload grammar (prefix groups, multi-turn), ``--sweep``
over rates and config keys, ``--plot`` and the progress bar, on a simulated 70B shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from simulated_helpers import LLAMA_3_70B

from brigade.bench.report import BenchError
from brigade.bench.spec import parse_sweep, parse_workload
from brigade.cli import main

VOCAB = 1000


@pytest.fixture(scope="module")
def simulated_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    model_dir = root / "llama-3-70b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA_3_70B), encoding="utf-8")
    config = root / "sim.toml"
    config.write_text(
        f'[model]\npath = "{model_dir}"\nmax_model_len = 4096\n'
        '[executor]\nplugin = "simulated"\ngpu = "H100"\nnum_gpus = 4\n'
        "[kv]\nmax_memory_gib = 100\n[scheduler]\nmax_num_seqs = 32\n"
    )
    return config


# -- workload grammar -------------------------------------------------------------------------


def test_prefix_groups_share_their_prefix_and_keep_priorities() -> None:
    spec = parse_workload(
        "synthetic:requests=40,prefix_groups=4,prefix_len=50,prompt=fixed:10,"
        "output=fixed:3,priorities=0:1/1:1"
    )
    workload = spec.build(seed=0, vocab_size=VOCAB)
    assert len(workload) == 40
    assert all(len(r.prompt_token_ids) == 60 for r in workload)
    assert len({r.prompt_token_ids[:50] for r in workload}) == 4
    assert len({r.prompt_token_ids for r in workload}) == 40
    assert {r.priority for r in workload} == {0, 1}


def test_turns_make_conversations_that_extend_their_history() -> None:
    spec = parse_workload(
        "synthetic:requests=12,turns=3,think_time=0.5,prompt=fixed:8,output=fixed:4,rate=2"
    )
    workload = spec.build(seed=1, vocab_size=VOCAB)
    assert len(workload) == 12
    assert sorted(len(r.prompt_token_ids) for r in workload) == [8] * 4 + [20] * 4 + [32] * 4
    # Every later turn's prompt starts with an earlier turn's whole prompt.
    firsts = [r.prompt_token_ids for r in workload if len(r.prompt_token_ids) == 8]
    for request in workload:
        assert any(request.prompt_token_ids[:8] == first for first in firsts)


def test_turns_and_prefix_groups_combine() -> None:
    spec = parse_workload(
        "synthetic:requests=20,turns=2,prefix_groups=2,prefix_len=30,prompt=fixed:5,output=fixed:2"
    )
    workload = spec.build(seed=2, vocab_size=VOCAB)
    assert len({r.prompt_token_ids[:30] for r in workload}) == 2
    assert sorted({len(r.prompt_token_ids) for r in workload}) == [35, 42]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("synthetic:requests=10,turns=3", "not a multiple of turns=3"),
        ("synthetic:requests=10,prefix_groups=3,prefix_len=8", "not a multiple of prefix_groups"),
        ("synthetic:requests=10,prefix_groups=2", "go together"),
        ("synthetic:requests=10,prefix_len=0,prefix_groups=2", "prefix_len='0'"),
        ("synthetic:requests=10,turns=x", "turns='x' is not allowed"),
        ("synthetic:requests=10,think_time=2", "give turns=T too"),
        ("synthetic:requests=10,turns=2,think_time=-1", "think_time='-1'"),
    ],
)
def test_bad_grammar_says_what_is_allowed(spec: str, message: str) -> None:
    with pytest.raises(BenchError, match=message):
        parse_workload(spec)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rate", "use rate=R1,R2"),
        ("rate=1,x", "rate value 'x'"),
        ("rate=0,2", "rate value '0'"),
        ("batch=1,2", "station.key=V1,V2"),
        ("kv.page_size=8,8", "repeats a value"),
    ],
)
def test_bad_sweeps_say_what_is_allowed(text: str, message: str) -> None:
    with pytest.raises(BenchError, match=message):
        parse_sweep(text)


def test_a_rate_sweep_needs_a_synthetic_workload(
    tmp_path: Path, simulated_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_time": 0, "prompt_len": 4, "output_len": 2}\n')
    argv = ["bench", "--config", str(simulated_config), "--workload", str(trace)]
    assert main([*argv, "--sweep", "rate=1,2"]) == 2
    assert "--sweep rate needs a synthetic workload" in capsys.readouterr().err


# -- sweeps and plots -------------------------------------------------------------------------


def test_a_rate_sweep_gives_a_throughput_latency_curve_and_plots(
    tmp_path: Path, simulated_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    workload = "synthetic:requests=120,prompt=uniform:64:512,output=fixed:32"
    argv = ["bench", "--config", str(simulated_config), "--workload", workload]
    argv += ["--sweep", "rate=2,8,200", "--json", str(out), "--plot", str(plots)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "### sim" in captured.out
    assert "| rate | request_throughput | output_throughput |" in captured.out
    assert "| 200 |" in captured.out
    sweep = json.loads(out.read_text())["configs"]["sim"]["sweep"]
    assert sweep["key"] == "rate"
    assert sweep["values"] == ["2", "8", "200"]
    throughput = sweep["curves"]["request_throughput"]
    ttft = sweep["curves"]["ttft_p50_ms"]
    # Below capacity the engine keeps up with the offered rate; far above it, it saturates
    # and requests queue, so TTFT grows.
    assert throughput[0] == pytest.approx(2, rel=0.3)
    assert throughput[0] < throughput[1] < throughput[2]
    assert ttft[2] > ttft[0]
    assert len(sweep["points"]) == 3
    assert all(p["failed_requests"]["mean"] == 0 for p in sweep["points"])
    for name in ("latency_cdf.png", "sweep_throughput.png", "sweep_latency.png"):
        data = (plots / name).read_bytes()
        assert data.startswith(b"\x89PNG")
        assert len(data) > 10_000
    assert "wrote" in captured.err


def test_a_config_key_sweep_rebuilds_the_engine_per_value(
    tmp_path: Path, simulated_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep.json"
    workload = "synthetic:requests=16,prompt=fixed:2048,output=fixed:8"
    argv = ["bench", "--config", str(simulated_config), "--workload", workload, "--json", str(out)]
    assert main([*argv, "--sweep", "scheduler.max_num_batched_tokens=256,4096"]) == 0
    assert "| scheduler.max_num_batched_tokens |" in capsys.readouterr().out
    ttft = json.loads(out.read_text())["configs"]["sim"]["sweep"]["curves"]["ttft_p50_ms"]
    # 256-token chunks re-read the 70B weights eight times per prompt: slower to first token.
    assert ttft[0] > ttft[1]


def test_plot_without_matplotlib_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, simulated_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    argv = ["bench", "--config", str(simulated_config), "--workload", "synthetic:requests=2"]
    assert main([*argv, "--plot", "plots"]) == 2
    assert "pip install 'brigade-llm[bench]'" in capsys.readouterr().err


@pytest.mark.parametrize("quiet", [False, True])
def test_progress_bar_on_a_terminal_unless_quiet(
    quiet: bool,
    monkeypatch: pytest.MonkeyPatch,
    simulated_config: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = ["bench", "--config", str(simulated_config), "--workload", "synthetic:requests=6"]
    assert main(argv + (["--quiet"] if quiet else [])) == 0
    err = capsys.readouterr().err
    assert ("6/6" in err) != quiet
