"""Core opens the model once per engine and every station reads that one checkpoint.

An engine start (``LLM(...)`` offline, ``build_state`` under ``brigade serve``) reads the model
directory's ``config.json`` and ``generation_config.json`` once each, whichever executor runs,
and hands the same :class:`Checkpoint` to the executor and the sampler. Reads are counted
where every Python read of a file passes: ``open`` (``Path.read_text`` goes through
``io.open``).
"""

from __future__ import annotations

import builtins
import collections
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from brigade import LLM
from brigade.config import load_config
from brigade.models.create import create_model
from brigade.registry import default_registry

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = create_model(
        tmp_path_factory.mktemp("m") / "llama", overrides={"num_hidden_layers": 2}
    )
    assert all((directory / name).is_file() for name in CONFIG_FILES)
    return directory


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch, model_dir: Path) -> collections.Counter[str]:
    """How often each file of ``model_dir`` was opened since the test began."""
    counts: collections.Counter[str] = collections.Counter()
    real_open = io.open
    directory = model_dir.resolve()

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, str | bytes | os.PathLike):
            path = Path(os.fsdecode(file))
            if path.parent.resolve() == directory:
                counts[path.name] += 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    return counts


def settings(model_dir: Path, executor: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"executor.plugin={executor}",
        "kv.page_size=4",
        "kv.num_pages=64",
        "model.dtype=float32",
    ]


def start_offline(model_dir: Path, executor: str) -> Any:
    return LLM(overrides=settings(model_dir, executor)).engine


def start_server(model_dir: Path, executor: str) -> Any:
    from brigade.server.serve import build_state

    registry = default_registry()
    state = build_state(
        load_config(None, registry, overrides=settings(model_dir, executor)), registry
    )
    state.async_engine.shutdown()
    return state.async_engine.engine


@pytest.mark.parametrize("start", [start_offline, start_server], ids=["LLM", "serve"])
@pytest.mark.parametrize("executor", ["torch", "simulated"])
def test_an_engine_start_reads_each_config_file_once(
    start: Callable[[Path, str], Any],
    executor: str,
    model_dir: Path,
    reads: collections.Counter[str],
) -> None:
    engine = start(model_dir, executor)
    assert {name: reads[name] for name in CONFIG_FILES} == dict.fromkeys(CONFIG_FILES, 1)
    assert engine.executor.params.checkpoint is engine.checkpoint
    assert engine.sampler.params.checkpoint is engine.checkpoint


def test_the_checkpoint_reads_generation_config_once(
    model_dir: Path, reads: collections.Counter[str]
) -> None:
    from brigade.models.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(str(model_dir))
    for _ in range(2):
        checkpoint.sampling_defaults()
        assert checkpoint.eos_token_ids
    assert reads["config.json"] == 1
    assert reads["generation_config.json"] == 1


def test_core_hands_the_executor_the_checkpoints_own_dtype(tmp_path: Path) -> None:
    directory = create_model(
        tmp_path / "bf16", overrides={"num_hidden_layers": 1}, dtype="bfloat16"
    )
    engine = LLM(overrides=[f"model.path={directory}", "kv.page_size=4", "kv.num_pages=16"]).engine
    assert engine.config["model"].settings.dtype == "auto"
    assert engine.executor.params.dtype == "bfloat16"
    assert {p.dtype for p in engine.executor.model.parameters()} == {torch.bfloat16}
