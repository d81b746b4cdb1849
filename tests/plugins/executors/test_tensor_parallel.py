"""Tensor parallelism on the CPU (gloo): a model split over 2 ranks computes the logits the
whole model computes, inside the engine too, and a dead rank stops the engine.

Each TP=2 executor spawns a process (about 3 s), so the executors are built once per module.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import build_hf_model, save_model
from engine_helpers import GREEDY, assert_same_greedy, make_llm, prompts, run
from executor_helpers import ATOL, NUM_PAGES, PAGE_SIZE, ShuffledPages, token_sequences

from brigade.errors import ConfigError, EngineDeadError
from brigade.interfaces import Checkpoint, ExecutorParams
from brigade.model_input import SeqChunk, build_model_input
from brigade.models.checkpoint import open_checkpoint
from brigade.models.create import create_model
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions
from brigade.testing.parity import assert_greedy_match, reference_greedy

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Biases on o_proj and down_proj (added once, after the sum), tied embeddings, and a
    # vocabulary that does not split evenly (255 = 128 + 127 padded to 128).
    "llama-bias-tied-odd-vocab": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True, "vocab_size": 255},
    ),
    "mistral-window": ("mistral", {"sliding_window": 6, "head_dim": 32}),
    "qwen2": ("qwen2", {}),
    # One KV head for 2 ranks: it is replicated on both.
    "qwen3-one-kv-head": ("qwen3", {"head_dim": 32, "num_key_value_heads": 1}),
}


def make_executor(directory: Path, tp: int, num_pages: int = NUM_PAGES) -> TorchExecutor:
    params = ExecutorParams(
        model_path=str(directory),
        dtype="float32",
        attention=SdpaBackend(),
        page_size=PAGE_SIZE,
        kv_cache_dtype="auto",
        max_model_len=0,
        checkpoint=open_checkpoint(str(directory)),
    )
    executor = TorchExecutor(params, TorchExecutorOptions(device="cpu", tensor_parallel_size=tp))
    executor.initialize_kv_cache(num_pages)
    return executor


@pytest.fixture(scope="module")
def pairs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], tuple[TorchExecutor, TorchExecutor]]]:
    """``pairs(variant)``: (TP=1, TP=2) executors on one checkpoint, once per module."""
    made: dict[str, tuple[TorchExecutor, TorchExecutor]] = {}

    def get(name: str) -> tuple[TorchExecutor, TorchExecutor]:
        if name not in made:
            family, config = VARIANTS[name]
            directory = tmp_path_factory.mktemp(name)
            save_model(build_hf_model(family, **config), directory)
            made[name] = (make_executor(directory, 1), make_executor(directory, 2))
        return made[name]

    yield get
    for _, split in made.values():
        split.shutdown()


@pytest.mark.parametrize("name", VARIANTS)
def test_two_ranks_compute_the_logits_of_the_whole_model(
    name: str, pairs: Callable[[str], tuple[TorchExecutor, TorchExecutor]]
) -> None:
    whole, split = pairs(name)
    layer, shard = whole.model.attention_layers[0], split.model.attention_layers[0]
    assert shard.num_heads == layer.num_heads // 2
    assert shard.num_kv_heads == max(1, layer.num_kv_heads // 2)  # the KV pool holds these
    pages = ShuffledPages()
    lengths = [9, 3]
    tokens = token_sequences(lengths, seed=3)
    tables = [pages.take(n + 2) for n in lengths]
    prefill = build_model_input(
        [SeqChunk(t, 0, table) for t, table in zip(tokens, tables, strict=True)], PAGE_SIZE
    )
    decode = build_model_input(
        [SeqChunk([7], n, table) for n, table in zip(lengths, tables, strict=True)], PAGE_SIZE
    )
    for step in (prefill, decode):  # the decode step reads the KV the prefill wrote
        expected, got = whole.execute(step), split.execute(step)
        assert got.shape == expected.shape == (2, whole.model.vocab_size)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_forked_pages_and_pooled_hidden_states_match_the_whole_model(
    pairs: Callable[[str], tuple[TorchExecutor, TorchExecutor]],
) -> None:
    whole, split = pairs("llama-bias-tied-odd-vocab")
    prompt = token_sequences([8], seed=5)[0]
    step = build_model_input([SeqChunk(prompt, 0, [30, 31])], PAGE_SIZE)
    # Every row's final hidden state, as an embedding request asks for them.
    pooled = dataclasses.replace(step, hidden_indices=torch.arange(len(prompt)))
    expected, got = (
        whole.execute_with_hidden_states(pooled),
        split.execute_with_hidden_states(pooled),
    )
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0)
    # A fork copies the pages on every rank: decoding from the copies reads each rank's heads.
    for executor in (whole, split):
        executor.copy_pages([30, 31], [32, 33])
    fork = build_model_input([SeqChunk([9], len(prompt), [32, 33, 34])], PAGE_SIZE)
    torch.testing.assert_close(split.execute(fork), whole.execute(fork), atol=ATOL, rtol=0)


def test_a_batch_refused_on_rank_0_leaves_the_ranks_in_step(
    pairs: Callable[[str], tuple[TorchExecutor, TorchExecutor]],
) -> None:
    whole, split = pairs("qwen2")
    wrong_pages = build_model_input([SeqChunk([1, 2, 3], 0, [40])], PAGE_SIZE * 2)
    with pytest.raises(ValueError, match="page_size"):
        split.execute(wrong_pages)
    step = build_model_input([SeqChunk([1, 2, 3], 0, [41])], PAGE_SIZE)
    torch.testing.assert_close(split.execute(step), whole.execute(step), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("config", "tp", "message"),
    [
        ({"num_attention_heads": 4, "num_key_value_heads": 4}, 3, "4 attention heads"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48},
            2,
            "3 KV heads neither split evenly",
        ),
        ({"intermediate_size": 130}, 4, "intermediate_size 130"),
    ],
)
def test_models_that_do_not_split_are_refused_before_any_rank_starts(
    tmp_path: Path, config: dict[str, Any], tp: int, message: str
) -> None:
    save_model(build_hf_model("llama", **config), tmp_path)
    running = _brigade_ranks()  # the module's executors
    with pytest.raises(ConfigError, match=f"tensor_parallel_size = {tp}: .*{message}"):
        make_executor(tmp_path, tp)
    assert _brigade_ranks().keys() == running.keys()


def test_compile_is_refused_with_tensor_parallelism(tmp_path: Path) -> None:
    save_model(build_hf_model("llama"), tmp_path)
    params = ExecutorParams(
        model_path=str(tmp_path),
        dtype="float32",
        attention=SdpaBackend(),
        page_size=PAGE_SIZE,
        kv_cache_dtype="auto",
        max_model_len=0,
        checkpoint=open_checkpoint(str(tmp_path)),
    )
    options = TorchExecutorOptions(device="cpu", tensor_parallel_size=2, compile=True)
    with pytest.raises(ConfigError, match="compile"):
        TorchExecutor(params, options)


def test_a_safetensors_rank_reads_only_its_slices(tmp_path: Path) -> None:
    save_model(build_hf_model("llama", vocab_size=255), tmp_path)
    checkpoint = open_checkpoint(str(tmp_path))
    whole = dict(checkpoint.weights(torch.float32, "cpu"))
    parts = {
        "model.embed_tokens.weight": (0, 128, 128),  # clipped: rows 128..254
        "model.layers.0.self_attn.o_proj.weight": (1, 32, 32),
    }
    sliced = dict(checkpoint.weight_slices(torch.float32, "cpu", parts.get))
    assert torch.equal(
        sliced["model.embed_tokens.weight"], whole["model.embed_tokens.weight"][128:]
    )
    assert torch.equal(
        sliced["model.layers.0.self_attn.o_proj.weight"],
        whole["model.layers.0.self_attn.o_proj.weight"][:, 32:64],
    )
    assert torch.equal(sliced["model.norm.weight"], whole["model.norm.weight"])
    # What a GGUF rank does: read whole (dequantized), then narrow; the same slices.
    default = dict(Checkpoint.weight_slices(checkpoint, torch.float32, "cpu", parts.get))
    assert all(torch.equal(default[name], sliced[name]) for name in parts)


def test_a_gguf_checkpoint_crosses_to_a_rank_by_reopening_its_file() -> None:
    checkpoint = open_checkpoint("default")  # SmolLM2's GGUF: its mapping cannot be pickled
    copy = pickle.loads(pickle.dumps(checkpoint))
    assert copy is not checkpoint
    assert (copy.path, copy.name, copy.format) == (checkpoint.path, checkpoint.name, "gguf")
    assert copy.config == checkpoint.config
    assert copy.sampling_defaults() == checkpoint.sampling_defaults()


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("engine")
    return create_model(root / "llama", "llama", overrides={"num_hidden_layers": 2})


def test_the_engine_at_two_ranks_generates_what_transformers_does(engine_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    running = _brigade_ranks()
    # A 16-token budget mixes prefill chunks with decodes; 4-token pages cross boundaries.
    llm = make_llm(
        engine_model, "scheduler.max_num_batched_tokens=16", "executor.tensor_parallel_size=2"
    )
    try:
        token_prompts = prompts([5, 23, 40, 2])
        ours = run(llm, token_prompts)
        whole = run(make_llm(engine_model, "scheduler.max_num_batched_tokens=16"), token_prompts)
        assert_same_greedy(ours, whole, "tp=2 vs tp=1")
        reference = AutoModelForCausalLM.from_pretrained(
            engine_model, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        for prompt, (tokens, _) in zip(token_prompts, ours, strict=True):
            theirs, score = reference_greedy(reference, prompt, GREEDY.max_tokens)
            assert_greedy_match(tokens, theirs, score, atol=1e-4, label="tp=2 vs transformers")
        ranks = [r for pid, r in _brigade_ranks().items() if pid not in running]
        assert len(ranks) == 1
    finally:
        llm.engine.executor.shutdown()
    assert not any(rank.is_alive() for rank in ranks)
    assert _brigade_ranks().keys() == running.keys()


def test_a_dead_rank_kills_the_engine_instead_of_hanging(engine_model: Path) -> None:
    running = _brigade_ranks()
    llm = make_llm(engine_model, "executor.tensor_parallel_size=2")
    try:
        (rank,) = [r for pid, r in _brigade_ranks().items() if pid not in running]
        assert rank.pid is not None
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(10)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 .* exited"):
            llm.generate(prompts([6]), GREEDY)
        assert time.monotonic() - started < 10
    finally:
        llm.engine.executor.shutdown()
    assert _brigade_ranks().keys() == running.keys()


def _brigade_ranks() -> dict[int | None, Any]:
    """This process's live tensor-parallel rank processes, by pid."""
    children = multiprocessing.active_children()
    return {p.pid: p for p in children if p.name.startswith("brigade-tp-rank")}
