"""``brigade serve`` with vLLM's flags: what each sets, what is refused, and docs/vllm.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from brigade.cli import main
from brigade.config import EngineConfig, load_config
from brigade.registry import default_registry
from brigade.serve_args import update_doc
from brigade.serve_flags import FLAGS

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
ALIASES = [f for f in FLAGS if f.status == "alias"]
ACCEPTED = [f for f in FLAGS if f.status == "accepted"]
REFUSED = [(name, f.help) for f in FLAGS if f.status == "refused" for name in f.names]
BY_NAME = {n: f for f in ALIASES for n in f.names} | {
    f"--no-{n[2:]}": f for f in ALIASES if f.arity == "bool" for n in f.names
}


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, list[str]]]:
    """What ``brigade serve`` would hand to the server: (config path, overrides) per call."""
    import brigade.server.serve as serve_module

    calls: list[tuple[str | None, list[str]]] = []

    def fake_serve(config: str | None, overrides: list[str]) -> int:
        calls.append((config, list(overrides)))
        return 0

    monkeypatch.setattr(serve_module, "serve", fake_serve)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return calls


def effective(
    served: list[tuple[str | None, list[str]]],
    argv: list[str],
    environ: dict[str, str] | None = None,
) -> EngineConfig:
    """The config ``brigade serve ARGV`` would run with (loaded as the server loads it)."""
    assert main(["serve", *argv]) == 0
    config, overrides = served[-1]
    return load_config(config, default_registry(), overrides=overrides, environ=environ or {})


def value(config: EngineConfig, key: str) -> Any:
    station, name = key.split(".")
    table = config[station]
    if name == "plugin":
        return table.plugin
    for values in (table.settings, table.options):
        if values is not None and hasattr(values, name):
            return getattr(values, name)
    raise KeyError(key)


ALIAS_CASES = [
    (["./model.gguf"], "model.path", "./model.gguf"),
    (
        ["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"],
        "model.path",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    (["--served-model-name", "tiny"], "server.served_model_name", "tiny"),
    (["--host", "127.0.0.2"], "server.host", "127.0.0.2"),
    (["--port", "8080"], "server.port", 8080),
    (["--api-key", "a", "--api-key", "b"], "server.api_keys", ("a", "b")),
    (["--max-model-len", "4k"], "model.max_model_len", 4000),
    (["--dtype", "half"], "model.dtype", "float16"),
    (["--kv-cache-dtype", "bfloat16"], "kv.cache_dtype", "bfloat16"),
    (["--seed", "7"], "model.seed", 7),
    (["--chat-template", "{{ messages }}\n"], "model.chat_template", "{{ messages }}\n"),
    (["--generation-config", "vllm"], "model.generation_config", "none"),
    (["--block-size", "32"], "kv.page_size", 32),
    (["--num-gpu-blocks-override", "64"], "kv.num_pages", 64),
    (["--no-enable-prefix-caching"], "kv.enable_prefix_caching", False),
    (["--disable-cascade-attn"], "attention.cascade_decode", False),
    (["--swap-space", "2.5"], "kv.swap_space_gib", 2.5),
    (["--max-num-seqs", "8"], "scheduler.max_num_seqs", 8),
    (["--max-num-batched-tokens", "8K"], "scheduler.max_num_batched_tokens", 8192),
    (["--no-enable-chunked-prefill"], "scheduler.enable_chunked_prefill", False),
    (["--scheduling-policy", "priority"], "scheduler.plugin", "priority"),
    (["--device", "cpu"], "executor.device", "cpu"),
    (["-tp", "2"], "executor.tensor_parallel_size", 2),
    (["-dp", "3"], "router.data_parallel_size", 3),
    (["--distributed-executor-backend", "ray"], "executor.distributed_executor_backend", "ray"),
    (["--pooler-config", '{"pooling_type": "MEAN"}'], "server.embedding_pooling", "mean"),
    (["--api-server-count", "3"], "server.api_server_count", 3),
    (["-asc", "2"], "server.api_server_count", 2),
    (["--disable-frontend-multiprocessing"], "server.engine_process", False),
    (["--speculative-config", '{"method": "ngram"}'], "speculative.plugin", "ngram"),
]


@pytest.mark.parametrize(("argv", "key", "expected"), ALIAS_CASES)
def test_each_flag_sets_the_config_key_it_names(
    served: list, argv: list[str], key: str, expected: Any
) -> None:
    defaults = load_config(None, default_registry(), environ={})
    assert value(defaults, key) != expected, "the case would pass without the flag"
    assert value(effective(served, argv), key) == expected
    flag = BY_NAME.get(argv[0])
    assert flag is None or flag.key == key, "the table names another key"


def test_enforce_eager_keeps_a_gpu_on_the_eager_executor(
    served: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, declared
    assert value(effective(served, []), "executor.plugin") == "cuda-graph"
    assert value(effective(served, ["--enforce-eager"]), "executor.plugin") == "torch"
    assert BY_NAME["--enforce-eager"].key == "executor.plugin"


def test_speculative_config_sets_the_method_and_its_options(served: list) -> None:
    config = effective(
        served,
        [
            "--speculative-config",
            '{"method": "suffix", "num_speculative_tokens": 7, "disable_by_batch_size": 4,'
            ' "suffix_decoding_max_tree_depth": 20, "suffix_decoding_min_token_prob": 0.2}',
        ],
    )
    assert value(config, "speculative.plugin") == "suffix"
    assert value(config, "speculative.num_speculative_tokens") == 7
    assert value(config, "speculative.max_batch_size") == 4
    assert (
        config["speculative"].options.max_depth,
        config["speculative"].options.min_probability,
    ) == (20, 0.2)
    config = effective(
        served,
        [
            "--speculative-config",
            '{"method": "ngram", "prompt_lookup_max": 6, "prompt_lookup_min": 3}',
        ],
    )
    assert (config["speculative"].options.max_n, config["speculative"].options.min_n) == (6, 3)
    # vLLM infers a draft model from "model" alone.
    config = effective(
        served, ["--speculative-config", '{"model": "/models/draft", "num_speculative_tokens": 3}']
    )
    assert value(config, "speculative.plugin") == "draft-model"
    assert config["speculative"].options.model == "/models/draft"
    assert value(config, "speculative.num_speculative_tokens") == 3


def test_every_alias_in_the_table_has_a_case() -> None:
    tested = {BY_NAME[argv[0]].names[0] for argv, _, _ in ALIAS_CASES if argv[0] in BY_NAME}
    tested.add("--enforce-eager")  # its own test: the default it changes is a GPU's
    assert tested == {f.names[0] for f in ALIASES}


def test_a_flag_beats_the_file_and_the_environment_and_set_beats_the_flag(
    served: list, tmp_path: Path
) -> None:
    file = tmp_path / "engine.toml"
    file.write_text('[model]\npath = "from-file"\nmax_model_len = 1024\n')
    env = {"BRIGADE_MODEL__MAX_MODEL_LEN": "3000"}
    config = ["--config", str(file)]
    assert value(effective(served, config), "model.max_model_len") == 1024
    assert value(effective(served, config, env), "model.max_model_len") == 3000
    assert (
        value(effective(served, [*config, "--max-model-len", "2k"], env), "model.max_model_len")
        == 2000
    )
    for argv in (
        ["--max-model-len", "2k", "--set", "model.max_model_len=5000"],
        ["--set", "model.max_model_len=5000", "--max-model-len", "2k"],
    ):
        assert value(effective(served, [*config, *argv], env), "model.max_model_len") == 5000
    assert value(effective(served, ["./model.gguf", *config]), "model.path") == "./model.gguf"
    assert value(effective(served, config), "model.path") == "from-file"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("auto", "auto"),
        ("half", "float16"),
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("float", "float32"),
        ("float32", "float32"),
    ],
)
def test_vllm_dtypes_map_to_brigades(served: list, given: str, expected: str) -> None:
    assert value(effective(served, ["--dtype", given]), "model.dtype") == expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [("4096", 4096), ("4k", 4000), ("25.6k", 25600), ("32K", 32768), ("1m", 10**6), ("1M", 2**20)],
)
def test_lengths_read_as_vllm_reads_them(served: list, given: str, expected: int) -> None:
    assert value(effective(served, ["--max-model-len", given]), "model.max_model_len") == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-cache-dtype", "fp8"], "there is no fp8 KV cache yet; allowed: auto, bfloat16"),
        (["--kv-cache-dtype", "fp8_e4m3"], "there is no fp8 KV cache yet"),
        (["--dtype", "int8"], "--dtype int8: allowed: auto, half, float16"),
        (["--max-model-len", "auto"], "leave the flag out for the model's own limit"),
        (["--max-model-len", "-1"], "vLLM's auto and -1"),
        (["--max-model-len", "1.5K"], "decimals only with k, m, g or t"),
        (["--max-model-len", "lots"], "expected a token count such as 4096"),
        (["--device", "tpu"], "allowed: auto, cpu, cuda, cuda:N"),
        (["--scheduling-policy", "sjf"], "allowed: fcfs, priority"),
        (["--port", "http"], "--port http: expected an integer"),
        (["--swap-space", "-1"], "expected a number of GiB >= 0"),
        (["--tool-call-parser", "llama3_json"], "allowed: hermes"),
        (["--runner", "classify"], "allowed: auto, generate, pooling, embed, none"),
        (["--pooler-config", '{"pooling_type": "CLS"}'], "allowed: LAST, MEAN"),
        (["--pooler-config", '{"normalize": false}'], "server.embedding_normalize=false"),
        (["--pooler-config", "MEAN"], "expected a JSON object"),
        (["--served-model-name", "a", "b"], "Brigade serves one model name"),
        (["-tp", "0"], "--tensor-parallel-size 0: expected a whole number of ranks, 1 or more"),
        (["--tensor-parallel-size", "two"], "expected a whole number of ranks"),
        (["-dp", "0"], "--data-parallel-size 0: expected a whole number of ranks, 1 or more"),
        (["--distributed-executor-backend", "external_launcher"], "expected mp, uni or ray"),
        (["--served-model-name", "tiny", "./model.gguf"], "put MODEL before the flags"),
        (["M", "--model", "N"], "give the model once"),
        (["--config", "vllm.yaml"], "Brigade reads a TOML config, not vLLM's YAML"),
        (["--speculative-config", '{"method": "draft_model"}'], 'needs "model"'),
        (
            ["--speculative-config", '{"method": "ngram", "model": "d"}'],
            "model: not supported with method 'ngram'",
        ),
        (["--speculative-config", '{"method": "eagle3"}'], "'eagle3' is not implemented yet"),
        (
            ["--speculative-config", '{"method": "ngram", "suffix_decoding_max_tree_depth": 3}'],
            "not supported with method 'ngram'",
        ),
        (["--speculative-config", "[1]"], "expected a JSON object"),
    ],
)
def test_values_that_do_not_map_are_one_line_errors(
    served: list, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("brigade: error: ")
    assert message in err
    assert err.count("\n") == 1
    assert not served


@pytest.mark.parametrize(("name", "reason"), REFUSED)
def test_every_refused_vllm_flag_names_itself_and_exits_2(
    served: list, name: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in ([name], ["MODEL", name, "2"], [f"{name}=2", "MODEL"]):
        assert main(["serve", *argv]) == 2
        assert capsys.readouterr().err == f"brigade: error: {name}: {reason}\n"
    assert not served


def test_refused_reasons_name_the_brigade_equivalent() -> None:
    reasons = dict(REFUSED)
    assert "[kv] memory_fraction" in reasons["--gpu-memory-utilization"]
    assert "pipeline parallelism is not implemented yet" in reasons["-pp"]
    assert "[grammar] station" in reasons["--guided-decoding-backend"]


def test_flags_neither_brigade_nor_vllm_has_get_argparses_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--no-such-flag"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ACCEPTED, ids=lambda f: f.names[0])
def test_accepted_flags_change_nothing_and_print_their_note(
    served: list, flag: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in flag.names:
        sample = {"--tool-call-parser": "hermes", "--runner": "embed", "--task": "generate"}
        sample["--convert"] = "none"
        argv = [name] if flag.arity == "switch" else [name, sample.get(name, "9")]
        assert main(["serve", *argv]) == 0
        assert served[-1] == (None, []), "an accepted flag must not change the config"
        assert f"brigade: note: {name}: {flag.help}\n" in capsys.readouterr().err


def test_vllm_api_key_in_the_environment_is_the_key_as_in_vllm(
    served: list, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    assert value(effective(served, []), "server.api_keys") == ("secret",)
    assert "VLLM_API_KEY: clients must send it" in capsys.readouterr().err
    assert value(effective(served, ["--api-key", "mine"]), "server.api_keys") == ("mine",)


def test_serve_help_groups_the_flags_and_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    own, vllm, noted = (
        out.index("Brigade's arguments:"),
        out.index("vLLM-compatible flags"),
        out.index("vLLM flags accepted with no effect"),
    )
    assert own < out.index("  --config FILE") < vllm < out.index("  --max-model-len LEN") < noted
    assert noted < out.index("--trust-remote-code") < out.index("examples:")
    for example in (
        "brigade serve ./model.gguf --port 8080",
        "brigade serve HuggingFaceTB/SmolLM2-135M-Instruct --api-key K",
        "brigade serve --config engine.toml --set kv.page_size=32",
    ):
        assert example in out
    assert "  -tp" not in out, "refused flags stay out of --help"


def test_docs_flag_tables_are_up_to_date() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert update_doc(text) == text, (
        "docs/vllm.md is stale: run `.venv/bin/python -m brigade.serve_args docs/vllm.md`"
    )
    for flag in FLAGS:
        assert f"`{flag.names[0]}`" in text
