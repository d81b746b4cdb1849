"""Settings that would empty authentication or ask the machine for more than it has: config
errors naming the key, before any process starts or anything is allocated; from the command
line, one ``brigade: error:`` line and exit status 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import assert_refused, run_brigade

from brigade import limits
from brigade.config import check_config, load_config
from brigade.errors import ConfigError
from brigade.limits import MachineMemory
from brigade.models.create import create_model
from brigade.registry import Registry, load_registry

GIB = 1 << 30
BAD_KEYS = [
    ("", "is empty"),
    (" ", "is only whitespace"),
    ("  key", "starts or ends with whitespace"),
    ("key\t", "starts or ends with whitespace"),
    ("two words", "holds ' '"),
    ("nul\x00", "holds '\\x00'"),
]


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(
        tmp_path_factory.mktemp("limits") / "tiny", "llama", overrides={"num_hidden_layers": 2}
    )


@pytest.mark.parametrize(("key", "problem"), BAD_KEYS)
def test_a_key_that_is_empty_blank_or_not_a_token_is_refused_wherever_it_comes_from(
    key: str, problem: str, registry: Registry, tmp_path: Path
) -> None:
    file = tmp_path / "engine.toml"
    file.write_text(f"[server]\napi_keys = [{_toml_string('fine')}, {_toml_string(key)}]\n")
    sources = {
        "file": lambda: load_config(file, registry, environ={}),
        "--set": lambda: load_config(
            None, registry, overrides=[f"server.api_keys=['ok', {_toml_string(key)}]"]
        ),
        "environment": lambda: load_config(
            None, registry, environ={"BRIGADE_SERVER__API_KEYS": f"['ok', {_toml_string(key)}]"}
        ),
    }
    for source, load in sources.items():
        with pytest.raises(ConfigError, match=r"\[server\]: api_keys\[1\] = ") as refused:
            load()
        assert problem in str(refused.value), source
        assert "one or more visible characters" in str(refused.value), source
    for fine in ("k", "sk-0123_ABC.xyz~+/=", "clé"):
        assert load_config(None, registry, overrides=[f"server.api_keys=['{fine}']"])


@pytest.mark.parametrize("key", ["", " ", "  key"])
@pytest.mark.parametrize("command", ["config check", "serve"])
def test_the_command_line_refuses_an_empty_or_blank_key(
    command: str, key: str, tmp_path: Path
) -> None:
    file = tmp_path / "engine.toml"
    file.write_text(f'[model]\npath = "random-tiny"\n[server]\napi_keys = [{_toml_string(key)}]\n')
    argv = (
        ["config", "check", str(file)]
        if command == "config check"
        else ["serve", "--config", str(file)]
    )
    assert_refused(run_brigade(*argv), "api_keys[0] = ")


@pytest.mark.parametrize(
    ("argv", "env", "fragment"),
    [
        (["--api-key", ""], {}, "api_keys[0] = '' is empty"),
        (["--api-key", "k", "--api-key", " "], {}, "api_keys[1] = ' ' is only whitespace"),
        ([], {"VLLM_API_KEY": ""}, "VLLM_API_KEY = '' is empty"),
        ([], {"VLLM_API_KEY": "  "}, "VLLM_API_KEY = '  ' is only whitespace"),
        ([], {"BRIGADE_SERVER__API_KEYS": '[""]'}, "api_keys[0] = '' is empty"),
    ],
)
def test_serve_refuses_an_empty_key_from_flags_and_the_environment(
    argv: list[str], env: dict[str, str], fragment: str
) -> None:
    assert_refused(run_brigade("serve", "random-tiny", *argv, env=env), fragment)


def test_front_ends_are_held_to_the_cores(
    model_dir: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "machine_cores", lambda: 2)
    model = f"model.path={model_dir}"
    assert _checked(registry, model, "server.api_server_count=4")
    with pytest.raises(ConfigError) as refused:
        _checked(registry, model, "server.api_server_count=5")
    message = str(refused.value)
    for fragment in ("[server] api_server_count = 5", "2 CPU cores", "at most 4"):
        assert fragment in message


def test_engine_ranks_on_a_cpu_are_held_to_one_per_core(
    model_dir: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "machine_cores", lambda: 2)
    cpu = f"model.path={model_dir}", "executor.device=cpu"
    assert _checked(registry, *cpu, "executor.tensor_parallel_size=2")
    for overrides, ranks in (
        (["executor.tensor_parallel_size=3"], 3),
        (["router.data_parallel_size=2", "executor.tensor_parallel_size=2"], 4),
        (["router.data_parallel_size=3"], 3),
    ):
        with pytest.raises(ConfigError, match=rf"is {ranks} engine ranks computing on this "):
            _checked(registry, *cpu, *overrides)
    ray = "executor.distributed_executor_backend=ray"  # the cluster's cores, not these
    assert _checked(registry, *cpu, ray, "executor.tensor_parallel_size=4")


def test_simulated_replicas_count_only_where_processes_start(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``brigade bench`` simulates replicas in one process; serve and generate start them."""
    monkeypatch.setattr(limits, "machine_cores", lambda: 2)
    config = load_config(
        None, registry, overrides=["executor.plugin=simulated", "router.data_parallel_size=16"]
    )
    limits.check_process_counts(config, registry)
    with pytest.raises(ConfigError, match=r"data_parallel_size = 16 engine processes .* at most 4"):
        limits.check_process_counts(config, registry, starts_replicas=True)


def test_serve_refuses_a_thousand_front_ends_before_starting_one(tmp_path: Path) -> None:
    file = tmp_path / "engine.toml"
    file.write_text('[model]\npath = "random-tiny"\n[server]\napi_server_count = 1000\n')
    for argv in (["config", "check", str(file)], ["serve", "--config", str(file)]):
        assert_refused(run_brigade(*argv), "api_server_count = 1000", "CPU core")
    assert_refused(
        run_brigade("serve", "random-tiny", "--tensor-parallel-size", "1000"),
        "tensor_parallel_size = 1000",
    )


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["kv.num_pages=100000000"], "[kv] num_pages = 100000000"),
        (["scheduler.max_num_seqs=10000000"], "[scheduler] max_num_seqs = 10000000"),
        (["scheduler.max_num_batched_tokens=1000000000"], "max_num_batched_tokens = 1000000000"),
        (["scheduler.preemption=swap", "kv.swap_space_gib=2"], "[kv] swap_space_gib = 2"),
    ],
)
def test_what_the_settings_allocate_must_fit_the_machine(
    overrides: list[str],
    fragment: str,
    model_dir: Path,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(limits, "machine_memory", lambda **_: MachineMemory(GIB))
    with pytest.raises(ConfigError) as refused:
        _checked(registry, f"model.path={model_dir}", *overrides)
    message = str(refused.value)
    assert fragment in message
    assert "would need" in message
    assert "this machine has 1.0 GiB of memory" in message
    assert _checked(registry, f"model.path={model_dir}", "kv.num_pages=1000")


def test_a_simulated_pool_is_not_held_to_this_machine(
    model_dir: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulated executor allocates no KV pool: a datacenter's fits on a laptop."""
    monkeypatch.setattr(limits, "machine_memory", lambda **_: MachineMemory(GIB))
    simulated = [f"model.path={model_dir}", "executor.plugin=simulated"]
    assert _checked(registry, *simulated, "kv.num_pages=10000000")
    with pytest.raises(ConfigError, match="max_num_seqs = 10000000 rows"):
        _checked(registry, *simulated, "scheduler.max_num_seqs=10000000")


def test_the_pool_is_held_to_what_the_executor_has_free_before_it_is_allocated(
    model_dir: Path, registry: Registry
) -> None:
    from brigade.assemble import kv_pool_pages
    from brigade.interfaces import KVCacheSpec

    class Executor:
        def kv_cache_spec(self) -> KVCacheSpec:
            return KVCacheSpec(2, 16, 1 << 20, 100 << 20, 4096, 4000)

    def pages(num_pages: int) -> int:
        config = load_config(
            None, registry, overrides=[f"model.path={model_dir}", f"kv.num_pages={num_pages}"]
        )
        return kv_pool_pages(Executor(), config)  # type: ignore[arg-type]

    assert pages(100) == 100
    with pytest.raises(ConfigError, match=r"num_pages = 101 would need .* room for 100 pages"):
        pages(101)


@pytest.mark.parametrize(
    ("toml", "fragment"),
    [
        ("[kv]\nnum_pages = 99999999999999999999", "must fit in 64 bits"),
        ("[scheduler]\nmax_num_seqs = -99999999999999999999", "must fit in 64 bits"),
        ("[kv]\nmax_memory_gib = inf", "must be a finite number"),
        ("[server]\nshutdown_timeout_s = inf", "must be a finite number"),
        ("[kv]\nnum_pages = " + "9" * 5000, "an integer of more than 4300 digits"),
        ("[model]\npath = " + "[" * 5000 + "]" * 5000, "nested too deeply"),
        ("[model]\nx = " + "{a = " * 5000 + "1" + "}" * 5000, "nested too deeply"),
    ],
)
def test_absurd_values_and_deep_nesting_are_config_errors(
    toml: str, fragment: str, registry: Registry, tmp_path: Path
) -> None:
    file = tmp_path / "engine.toml"
    file.write_text(toml + "\n")
    with pytest.raises(ConfigError, match=fragment):
        load_config(file, registry, environ={})


def test_deep_nesting_in_the_environment_and_overrides_is_a_config_error(
    registry: Registry,
) -> None:
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(ConfigError, match=r"BRIGADE_MODEL__PATH: .*nested too deeply"):
        load_config(None, registry, environ={"BRIGADE_MODEL__PATH": deep})
    with pytest.raises(ConfigError, match=r"--set model.path: .*nested too deeply"):
        load_config(None, registry, overrides=[f"model.path={deep}"], environ={})


@pytest.mark.parametrize(
    ("command", "toml", "env", "fragment"),
    [
        ("config check", "[model]\npath = " + "[" * 5000 + "]" * 5000, {}, "nested too deeply"),
        (
            "config check",
            "",
            {"BRIGADE_SCHEDULER__MAX_NUM_SEQS": "[" * 5000},
            "BRIGADE_SCHEDULER__MAX_NUM_SEQS",
        ),
        ("generate", "[kv]\nnum_pages = 100000000000", {}, "[kv] num_pages = 100000000000"),
        ("serve", "[scheduler]\nmax_num_seqs = 10000000000", {}, "max_num_seqs = 10000000000"),
    ],
)
def test_the_command_line_answers_attacks_on_the_config_with_one_line(
    command: str, toml: str, env: dict[str, str], fragment: str, model_dir: Path, tmp_path: Path
) -> None:
    file = tmp_path / "engine.toml"
    model = "" if "[model]" in toml else f'[model]\npath = "{model_dir}"\n'
    file.write_text(f"{model}{toml}\n")
    argv = {
        "config check": ["config", "check", str(file)],
        "generate": ["generate", "--config", str(file), "--prompt", "x"],
        "serve": ["serve", "--config", str(file), "--port", "0"],
    }[command]
    assert_refused(run_brigade(*argv, env=env), fragment)


def test_a_deeply_nested_flag_value_is_one_short_line(capsys: pytest.CaptureFixture[str]) -> None:
    from brigade.cli import main

    assert main(["serve", "random-tiny", "--speculative-config", "[" * 100000]) == 2
    error = capsys.readouterr().err
    assert error.startswith("brigade: error: --speculative-config [[[")
    assert "(100000 characters)" in error
    assert len(error) < 400


def _checked(registry: Registry, *overrides: str) -> list[str]:
    return check_config(
        load_config(None, registry, overrides=list(overrides), environ={}), registry
    )


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return (
        '"'
        + "".join(c if c.isprintable() or c == " " else f"\\u{ord(c):04x}" for c in escaped)
        + '"'
    )


def test_generate_answers_a_non_utf8_prompts_file_and_a_huge_seed_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from brigade.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"\xff\xfe not text\n")
    assert main(["generate", "--prompts-file", str(prompts)]) == 2
    assert capsys.readouterr().err.startswith("brigade: error: cannot read --prompts-file: ")
    assert main(["generate", "--prompt", "x", "--seed", str(2**64)]) == 2
    assert "seed=18446744073709551616 is invalid: expected a 64-bit" in capsys.readouterr().err


def test_the_supervisor_leaves_a_gpu_model_to_its_engine(
    model_dir: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asking CUDA for its memory would start CUDA in the server's supervisor for its whole
    life: there a model that may run on a GPU is left to the engine, which asks."""
    asked: list[bool] = []

    def memory(*, gpus: bool = False) -> MachineMemory:
        asked.append(gpus)
        return MachineMemory(GIB, 80 * GIB if gpus else 0)

    monkeypatch.setattr(limits, "machine_memory", memory)
    monkeypatch.setattr(limits, "cuda_available", lambda: True)
    pool = [f"model.path={model_dir}", "kv.num_pages=100000"]  # 3 GiB: only a GPU holds it
    limits.check_machine(load_config(None, registry, overrides=pool, environ={}), registry)
    assert asked == []
    assert _checked(registry, *pool)
    assert asked == [True]
    with pytest.raises(ConfigError, match=r"this machine has 1\.0 GiB of memory: lower"):
        _checked(registry, *pool, "executor.device=cpu")  # on the CPU: the host's memory
    assert asked == [True, False]
