"""Config loading: defaults, typed options, clear errors, overrides, config check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from plugin_fakes import install_fake_plugin

from brigade.cli import main
from brigade.config import check_config, load_config
from brigade.errors import ConfigError, ModelLoadError
from brigade.interfaces import AttentionBackend, PageSizeRule, option
from brigade.models.create import create_model
from brigade.registry import Registry, load_registry


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "engine.toml"
    path.write_text(text)
    return path


def test_no_file_means_defaults(registry: Registry) -> None:
    config = load_config(None, registry)
    assert config["model"].settings.path == "default"
    assert config["kv"].settings.page_size == 16
    assert config["executor"].plugin == "torch"
    assert config["executor"].options.device == "auto"
    assert config["attention"].plugin == "cpu"
    assert config["scheduler"].settings.max_num_batched_tokens == 2048
    assert config.components == {
        "kv": "paged",
        "scheduler": "fcfs",
        "executor": "torch",
        "attention": "cpu",
        "sampler": "standard",
        "grammar": "xgrammar",
        "detokenizer": "incremental",
        "router": "round-robin",
    }


def test_file_values_are_typed_and_frozen(tmp_path: Path, registry: Registry) -> None:
    path = write(
        tmp_path,
        '[model]\ndtype = "bfloat16"\n[kv]\npage_size = 32\nmemory_fraction = 1\n'
        '[executor]\nplugin = "torch"\ndevice = "cpu"\n',
    )
    config = load_config(path, registry)
    assert config["model"].settings.dtype == "bfloat16"
    assert config["kv"].settings.page_size == 32
    assert config["kv"].settings.memory_fraction == 1.0
    assert isinstance(config["kv"].settings.memory_fraction, float)
    assert config["executor"].options.device == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config["kv"].settings.page_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[kv]\npagesize = 8\n",
            r"\[kv\] \(paged\): unknown key 'pagesize'.*did you mean 'page_size'",
        ),
        ('[kv]\npage_size = "big"\n', r"\[kv\] page_size: expected int, got str 'big'"),
        ("[kv]\npage_size = 0\n", r"\[kv\] page_size = 0 is out of range; must be >= 1"),
        ("[kv]\nenable_prefix_caching = 1\n", r"enable_prefix_caching: expected bool, got int"),
        ("[kv]\npage_size = true\n", r"page_size: expected int, got bool"),
        ('[model]\ndtype = "fp8"\n', r"\[model\] dtype = 'fp8' is not allowed; one of 'auto'"),
        ("[oven]\nheat = 3\n", r"unknown table \[oven\]; tables are model, kv"),
        ('[model]\nplugin = "x"\n', r"\[model\]: this table selects no plugin"),
        ('[attention]\nplugin = "flash"\n', r"no attention plugin named 'flash'.*sdpa"),
        ('[scheduler]\nplugin = "lottery"\n', r"no scheduler plugin named 'lottery'.*: fcfs"),
        ("[executor]\nthreads = 2\n", r"\(torch\): unknown key 'threads'.*num_threads"),
        (
            '[attention]\nplugin = "sdpa"\nnative_decode = false\n',
            r"\(sdpa\): unknown key 'native_decode'.*an option of attention plugin 'cpu'",
        ),
        ('[executor]\ndevice = "tpu"\n', r"device = 'tpu' is not allowed"),
        ("kv = 3\n", r"top-level key 'kv' must be a table"),
        ("[kv\n", r"not valid TOML"),
    ],
)
def test_bad_config_errors_name_file_key_and_allowed(
    tmp_path: Path, registry: Registry, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as excinfo:
        load_config(path, registry)
    if "TOML" not in message:
        assert str(path) in str(excinfo.value)


def test_missing_file_is_a_clear_error(tmp_path: Path, registry: Registry) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", registry)


def test_overrides_precedence_file_env_flag(tmp_path: Path, registry: Registry) -> None:
    path = write(tmp_path, "[kv]\npage_size = 8\nnum_pages = 10\n")
    env = {"BRIGADE_KV__PAGE_SIZE": "32", "BRIGADE_KV__NUM_PAGES": "20", "UNRELATED": "x"}
    config = load_config(path, registry, environ=env, overrides=["kv.num_pages=40"])
    assert config["kv"].settings.page_size == 32
    assert config["kv"].settings.num_pages == 40
    two = ["kv.page_size=4", "kv.num_pages=7", "kv.page_size=8"]
    config = load_config(None, registry, environ={}, overrides=two)
    assert (config["kv"].settings.page_size, config["kv"].settings.num_pages) == (8, 7)
    config = load_config(None, registry, environ={}, overrides=["model.path=/models/x"])
    assert config["model"].settings.path == "/models/x"
    with pytest.raises(ConfigError, match=r"station\.key=value"):
        load_config(None, registry, overrides=["page_size=3"])
    with pytest.raises(ConfigError, match="unknown station 'kvv'"):
        load_config(None, registry, environ={"BRIGADE_KVV__PAGE_SIZE": "3"})


def test_given_defaults_yield_to_the_file_env_and_flags(tmp_path: Path, registry: Registry) -> None:
    budget = {"scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 4096}}
    config = load_config(None, registry, environ={}, defaults=budget)
    settings = config["scheduler"].settings
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (256, 4096)
    assert config.plugin("scheduler") == "fcfs"  # defaults for settings name no plugin
    path = write(tmp_path, "[scheduler]\nmax_num_seqs = 8\n")
    env = {"BRIGADE_SCHEDULER__MAX_NUM_BATCHED_TOKENS": "512"}
    settings = load_config(path, registry, environ=env, defaults=budget)["scheduler"].settings
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (8, 512)
    flags = ["scheduler.max_num_batched_tokens=1024"]
    config = load_config(None, registry, environ={}, overrides=flags, defaults=budget)
    assert config["scheduler"].settings.max_num_batched_tokens == 1024
    assert config["scheduler"].settings.max_num_seqs == 256
    # without them, the options' own
    settings = load_config(None, registry, environ={})["scheduler"].settings
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (128, 2048)


@dataclasses.dataclass(frozen=True)
class WideOptions:
    block: int = option(256, help="kernel block", ge=1)


class WidePagesBackend(AttentionBackend):
    """A backend that reads only pages that are multiples of 256 (like flash-attn's)."""

    def __init__(self, options: WideOptions) -> None:
        self.options = options

    @classmethod
    def supported_page_sizes(cls, options: WideOptions) -> PageSizeRule:
        return PageSizeRule(multiple_of=options.block, minimum=options.block)

    def build_metadata(self, batch: object) -> None:
        return None

    def forward(self, *args: object) -> None:  # type: ignore[override]
        raise NotImplementedError


def test_check_rejects_page_size_the_backend_cannot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_fake_plugin(
        monkeypatch,
        "brigade-wide",
        lambda r: r.add("attention", "wide", WidePagesBackend, options=WideOptions),
    )
    registry = load_registry()
    path = write(tmp_path, '[attention]\nplugin = "wide"\n[kv]\npage_size = 16\n')
    with pytest.raises(
        ConfigError,
        match=r"page_size = 16 cannot be used by attention backend 'wide'; "
        r"it needs a multiple of 256",
    ):
        check_config(load_config(path, registry), registry)
    path = write(tmp_path, '[attention]\nplugin = "wide"\n[kv]\npage_size = 512\n')
    check_config(load_config(path, registry), registry)


def test_check_rejects_a_page_size_the_kv_manager_cannot_use(
    tmp_path: Path, registry: Registry
) -> None:
    path = write(tmp_path, '[kv]\nplugin = "radix"\n')
    with pytest.raises(ConfigError, match=r"page_size = 16 cannot be used by KV manager 'radix'"):
        check_config(load_config(path, registry), registry)
    path = write(tmp_path, '[kv]\nplugin = "radix"\npage_size = 1\n')
    check_config(load_config(path, registry), registry)


def test_check_reads_the_model_directory_without_loading_weights(
    tmp_path: Path, registry: Registry
) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    path = write(tmp_path, f'[model]\npath = "{model_dir}"\n')
    with pytest.raises(
        ConfigError, match=r"GPT2LMHeadModel is not supported; supported: .*LlamaForCausalLM"
    ):
        check_config(load_config(path, registry), registry)
    (model_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ModelLoadError, match=r"config\.json has no 'vocab_size'"):
        check_config(load_config(path, registry), registry)
    config = (create_model(tmp_path / "llama", "llama") / "config.json").read_text()
    (model_dir / "config.json").write_text(config)  # a valid config, and no weights at all
    simulated = ["executor.plugin=simulated"]  # it reads the config alone
    notes = check_config(load_config(path, registry, overrides=simulated), registry)
    assert any("LlamaForCausalLM" in n for n in notes)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors in"):  # torch loads them
        check_config(load_config(path, registry), registry)


def test_config_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, "[kv]\npage_size = 32\n")
    assert main(["config", "check", str(good)]) == 0
    assert "OK" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("[kv]\npage_size = -1\n")
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad} [kv] page_size = -1 is out of range" in err
    assert "Traceback" not in err


def test_config_show_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], registry: Registry
) -> None:
    assert main(["config", "show", "--set", "kv.page_size=64"]) == 0
    shown = write(tmp_path, capsys.readouterr().out)
    assert load_config(shown, registry, environ={})["kv"].settings.page_size == 64


PROCESSORS = '[sampler]\nlogits_processors = ["ban-words"]\n'


def test_logits_processors_are_selected_with_their_own_options(
    tmp_path: Path, registry: Registry
) -> None:
    path = write(
        tmp_path,
        PROCESSORS + '[sampler.logits_processor_options.ban-words]\nwords = ["Sorry"]\n'
        "token_ids = [3, 5]\n",
    )
    sampler = load_config(path, registry)["sampler"]
    assert sampler.settings.logits_processors == ("ban-words",)
    [entry] = sampler.chain
    assert entry.name == "ban-words"
    assert entry.options.words == ("Sorry",)
    assert entry.options.token_ids == (3, 5)
    assert load_config(None, registry)["sampler"].chain == ()
    # Without an options table the processor gets its defaults.
    [default] = load_config(write(tmp_path, PROCESSORS), registry)["sampler"].chain
    assert default.options.token_ids == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[sampler]\nlogits_processors = ["ban-wrds"]\n',
            r"\[sampler\] logits_processors\[0\]: no logits_processor plugin named 'ban-wrds'; "
            r"registered logits_processor plugins: ban-words",
        ),
        (
            '[sampler]\nlogits_processors = "ban-words"\n',
            r"\[sampler\] logits_processors: expected array of str, got str",
        ),
        (
            '[sampler]\nlogits_processors = ["ban-words", "ban-words"]\n',
            r"'ban-words' is listed twice",
        ),
        (
            PROCESSORS + "[sampler.logits_processor_options.ban-words]\ntoken_ids = 5\n",
            r"\[sampler.logits_processor_options.ban-words\] token_ids: expected array of int",
        ),
        (
            PROCESSORS + "[sampler.logits_processor_options.ban-words]\ntoken_ids = [-2]\n",
            r"\[sampler.logits_processor_options.ban-words\]: token_ids must be >= 0, got \[-2\]",
        ),
        (
            PROCESSORS + '[sampler.logits_processor_options.ban-words]\nword = ["x"]\n',
            r"ban-words\]: unknown key 'word'; allowed: words, token_ids \(did you mean 'words'",
        ),
        (
            "[sampler.logits_processor_options.ban-words]\ntoken_ids = [1]\n",
            r"logits_processor_options.ban-words: options for a logits_processor that "
            r"logits_processors does not list \(listed: \(none\)\)",
        ),
        (
            "[sampler]\nlogits_processor_options = 3\n",
            r"logits_processor_options: expected a table of option tables",
        ),
        (
            "[sampler]\nlogits_processor = []\n",
            r"unknown key 'logits_processor'; allowed: plugin, logits_processors, "
            r"logits_processor_options",
        ),
    ],
)
def test_bad_logits_processor_config_names_the_processor(
    tmp_path: Path, registry: Registry, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as excinfo:
        load_config(path, registry)
    assert str(path) in str(excinfo.value)


def test_logits_processors_from_flags_and_config_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], registry: Registry
) -> None:
    flags = [
        "--set",
        'sampler.logits_processors=["ban-words"]',
        "--set",
        "sampler.logits_processor_options={ban-words = {token_ids = [7]}}",
    ]
    assert main(["config", "show", *flags]) == 0
    shown = capsys.readouterr().out
    assert "[sampler.logits_processor_options.ban-words]\n" in shown
    [entry] = load_config(write(tmp_path, shown), registry, environ={})["sampler"].chain
    assert entry.options.token_ids == (7,)
    bad = tmp_path / "bad.toml"
    bad.write_text('[sampler]\nlogits_processors = ["nope"]\n')
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "no logits_processor plugin named 'nope'" in err
    assert "ban-words" in err
    assert "Traceback" not in err
