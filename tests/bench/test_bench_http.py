"""``brigade bench --endpoint``: the same seeded workload over streaming /v1/completions
against a real ``brigade serve`` on 127.0.0.1, side by side with an in-process run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_harness import free_port, running_server, tiny_model, tiny_server_config

from brigade.bench.cli import parse_workload
from brigade.bench.endpoint import Endpoint, run_endpoint, text_prompt
from brigade.bench.report import BenchError
from brigade.cli import main

WORKLOAD = "synthetic:requests=8,prompt=uniform:4:24,output=fixed:6,rate=100,priorities=0:1/1:1"
KEY = "bench-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("bench-http"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tiny_server_config(
        model_dir, max_model_len=256, num_pages=256, server=f'api_keys = ["{KEY}"]\n'
    )
    with running_server(config, tmp_path_factory.mktemp("srv")) as (base, _):
        yield f"{base}/v1"


def bench(*argv: str) -> int:
    return main(["bench", "--workload", WORKLOAD, "--api-key", KEY, "--quiet", *argv])


def test_an_endpoint_and_an_in_process_config_get_the_same_workload(
    server: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "inproc.toml"
    config.write_text(f'[model]\npath = "{model_dir}"\n[kv]\npage_size = 8\nnum_pages = 128\n')
    out = tmp_path / "bench.json"
    argv = ["--config", str(config), "--endpoint", server, "--model", "tiny"]
    assert bench(*argv, "--slo", "ttft=60s", "--json", str(out)) == 0
    captured = capsys.readouterr()
    host = server.removeprefix("http://").removesuffix("/v1")
    assert captured.out.splitlines()[0] == f"| metric | inproc | {host} |"
    assert "failed" not in captured.err
    result = json.loads(out.read_text())["configs"]
    assert result[host]["endpoint"] == server
    expected_tokens = sum(r.output_len for r in parse_workload(WORKLOAD).build(0, 4000))
    for name in ("inproc", host):
        metrics = {key: value["mean"] for key, value in result[name]["metrics"].items()}
        assert metrics["failed_requests"] == 0
        assert metrics["output_tokens"] == expected_tokens  # ignore_eos honoured, usage counted
        assert 0 < metrics["ttft_p50_ms"] <= metrics["e2e_p50_ms"]
        assert metrics["ttft_p99_ms"] <= metrics["e2e_p99_ms"]
        assert 0 < metrics["itl_p50_ms"] <= metrics["itl_p99_ms"]
        assert metrics["request_throughput"] > 0
        assert metrics["goodput_fraction"] == 1.0
    # Over HTTP the engine's counters are not visible: those metrics are left out.
    assert "preemptions" not in result[host]["metrics"]
    assert "prefix_hit_rate" in result["inproc"]["metrics"]


def test_text_prompts_reach_a_server_and_count_tokens_from_usage(server: str) -> None:
    workload = parse_workload(WORKLOAD).build(seed=3, vocab_size=4000)
    endpoint = Endpoint(server, "tiny", prompt_format="text", max_concurrency=2, api_key=KEY)
    run = run_endpoint(endpoint, workload)
    assert run.errors == []
    assert run.short_outputs == 0
    assert [t.output_tokens for t in run.timings] == [r.output_len for r in workload]
    assert all(len(t.itl_s) >= 1 for t in run.timings)
    assert text_prompt([10, 11, 10]).split()[0] == text_prompt([10]).strip()


def test_endpoint_errors_are_counted_not_raised(
    server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    assert bench("--endpoint", server, "--model", "no-such-model", "--json", str(out)) == 0
    captured = capsys.readouterr()
    assert "8 of 8 requests failed; first: HTTP 404" in captured.err
    assert "no-such-model" in captured.err
    (metrics,) = (c["metrics"] for c in json.loads(out.read_text())["configs"].values())
    assert metrics["failed_requests"]["mean"] == 8
    assert metrics["request_throughput"]["mean"] == 0


def test_an_unreachable_endpoint_fails_every_request() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    workload = parse_workload("synthetic:requests=3,prompt=fixed:4,output=fixed:2").build(0, 100)
    run = run_endpoint(Endpoint(url, "m", request_timeout_s=5), workload)
    assert run.timings == []
    assert len(run.errors) == 3
    assert run.errors[0].startswith("ConnectError")
    assert run.metrics.num_failed == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--endpoint", "http://127.0.0.1:1/v1"], "--endpoint needs --model"),
        (["--endpoint", "127.0.0.1:1", "--model", "m"], "give an http"),
        (
            ["--endpoint", "http://127.0.0.1:1/v1", "--model", "m", "--max-concurrency", "0"],
            "--max-concurrency 0",
        ),
        (
            ["--endpoint", "http://127.0.0.1:1/v1", "--model", "m", "--sweep", "kv.x=1,2"],
            "cannot apply to --endpoint",
        ),
        ([], "at least one --config or --endpoint"),
    ],
)
def test_bad_endpoint_arguments_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench(*argv) == 2
    assert message in capsys.readouterr().err


def test_endpoint_validation_raises_bench_errors() -> None:
    with pytest.raises(BenchError, match="--request-timeout"):
        Endpoint("http://127.0.0.1:1/v1", "m", request_timeout_s=0)
