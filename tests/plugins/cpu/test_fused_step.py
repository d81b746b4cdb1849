"""The fused step (``decode_layers``: every decoder layer of a step in one C++ call)
gives the eager forward's logits bit for bit, on each architecture it covers, with each GEMM
mode, in float32 and bfloat16, across steps and shuffled pages, for decode steps and steps with
prefill chunks; other models, and chunks the C++ prefill kernel does not take, keep the eager
layers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from executor_helpers import PAGE_SIZE, ShuffledPages, make_executor, token_sequences

from brigade.model_input import SeqChunk, build_model_input
from brigade.models.create import create_model
from brigade.plugins.cpu import fused_step
from brigade.plugins.cpu.build import cpu_ops

MODELS = {
    "llama": {},
    "mistral": {"sliding_window": 6},  # a window shorter than the contexts below
    "qwen2": {},  # biases on q, k, v
    "qwen3": {},  # qk norm: not covered, stays eager
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused-decode")
    return {
        arch: create_model(root / arch, arch, overrides={"num_hidden_layers": 2, **extra})
        for arch, extra in MODELS.items()
    }


def fused_and_eager(
    directory: Path, cpu_linear: str, dtype: str, kv_cache_dtype: str = "auto"
) -> tuple[Any, Any]:
    """Two executors of one model: the fused step on, and off (the eager layers)."""

    def build(fused: bool) -> Any:
        return make_executor(
            directory,
            cpu_linear=cpu_linear,
            fused_decode=fused,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
        )

    return build(True), build(False)


def assert_same_logits(ours: list[torch.Tensor], theirs: list[torch.Tensor], case: str) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"{case}, step {step}: logits differ"


@contextlib.contextmanager
def counting_fused_calls() -> Iterator[list[int]]:
    """Counts the fused step's ``decode_layers`` calls (in the list's one element) while
    open."""
    ops = cpu_ops()
    assert ops is not None, "the CPU kernels failed to build"
    calls = [0]

    class Counting:
        def __getattr__(self, name: str) -> object:
            calls[0] += name == "decode_layers"
            return getattr(ops, name)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_step, "cpu_ops", Counting)
        yield calls


def decode_logits(executor: object, steps: int = 4) -> tuple[list[torch.Tensor], int]:
    """Prefill three prompts, then ``steps`` greedy decode steps of all three rows; returns
    each decode step's logits and how often ``decode_layers`` ran (prefills included)."""
    with counting_fused_calls() as calls:
        return _decode_logits(executor, steps), calls[0]


def _decode_logits(executor: object, steps: int) -> list[torch.Tensor]:
    pages = ShuffledPages(seed=3)
    prompts = token_sequences([5, 9, 3], seed=4)
    tables = [pages.take(len(p) + steps) for p in prompts]
    sequences = [list(p) for p in prompts]
    for prompt, table in zip(prompts, tables, strict=True):
        executor.execute(build_model_input([SeqChunk(prompt, 0, table)], PAGE_SIZE))  # type: ignore[attr-defined]
    # The first decode tokens: fixed, so both executors see the same inputs.
    next_tokens = [11, 22, 33]
    outputs = []
    for _ in range(steps):
        chunks = [
            SeqChunk([token], len(seq), table)
            for token, seq, table in zip(next_tokens, sequences, tables, strict=True)
        ]
        logits = executor.execute(build_model_input(chunks, PAGE_SIZE))  # type: ignore[attr-defined]
        outputs.append(logits)
        for seq, token in zip(sequences, next_tokens, strict=True):
            seq.append(token)
        next_tokens = logits.argmax(dim=-1).tolist()
    return outputs


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("cpu_linear", ["panels", "packed", "onednn", "plain"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_steps_equal_the_eager_layers(
    model_dirs: dict[str, Path], arch: str, cpu_linear: str, dtype: str
) -> None:
    fused, eager = fused_and_eager(model_dirs[arch], cpu_linear, dtype)
    ours, fused_calls = decode_logits(fused)
    theirs, eager_calls = decode_logits(eager)
    assert eager_calls == 0
    # the three prefills and every decode step
    assert fused_calls == (0 if arch == "qwen3" else 3 + len(ours)), "the fused step did not run"
    assert_same_logits(ours, theirs, f"{arch}, {cpu_linear}, {dtype}")


def mixed_logits(executor: object) -> tuple[list[torch.Tensor], int]:
    """Steps with prefill chunks: two prompts in one step, then steps of two decode rows beside
    a third prompt's chunks (the first chunk a whole page and more, the second after it); the
    logits of every step and how often ``decode_layers`` ran."""
    pages = ShuffledPages(seed=5)
    prompts = token_sequences([7, 4, 21], seed=6)
    tables = [pages.take(len(p) + 3) for p in prompts]
    outputs = []
    with counting_fused_calls() as calls:
        steps = [
            [SeqChunk(prompts[0], 0, tables[0]), SeqChunk(prompts[1], 0, tables[1])],
            [
                SeqChunk([5], len(prompts[0]), tables[0]),
                SeqChunk([6], len(prompts[1]), tables[1]),
                SeqChunk(prompts[2][:18], 0, tables[2]),
            ],
            [
                SeqChunk([7], len(prompts[0]) + 1, tables[0]),
                SeqChunk([8], len(prompts[1]) + 1, tables[1]),
                SeqChunk(prompts[2][18:], 18, tables[2]),
            ],
        ]
        for chunks in steps:
            outputs.append(executor.execute(build_model_input(chunks, PAGE_SIZE)))  # type: ignore[attr-defined]
    return outputs, calls[0]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("cpu_linear", ["panels", "onednn", "plain"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_steps_with_prefill_chunks_equal_the_eager_layers(
    model_dirs: dict[str, Path], arch: str, cpu_linear: str, dtype: str
) -> None:
    # The chunks' attention by the cpu backend's C++ prefill kernel (on AMX tiles for
    # bfloat16 where the CPU has them), in the fused call as in the eager layers.
    fused, eager = fused_and_eager(model_dirs[arch], cpu_linear, dtype)
    ours, fused_calls = mixed_logits(fused)
    theirs, eager_calls = mixed_logits(eager)
    assert (fused_calls, eager_calls) == (len(ours), 0), "the fused step did not run"
    assert_same_logits(ours, theirs, f"{arch}, {cpu_linear}, {dtype}")


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"), [("float32", "bfloat16"), ("bfloat16", "float32")]
)
def test_fused_steps_on_a_cache_of_another_dtype_equal_the_eager_layers(
    model_dirs: dict[str, Path], dtype: str, cache_dtype: str
) -> None:
    # The layer's new keys and values are converted to the cache's dtype as the eager
    # forward converts them (the fused RoPE-and-write covers a cache of the model's dtype).
    fused, eager = fused_and_eager(model_dirs["llama"], "panels", dtype, cache_dtype)
    assert fused.kv_caches[0][0].dtype == getattr(torch, cache_dtype)
    ours, fused_calls = decode_logits(fused)
    theirs, _ = decode_logits(eager)
    assert fused_calls == 3 + len(ours), "the fused step did not run"
    assert_same_logits(ours, theirs, f"{dtype} on a {cache_dtype} cache")


def test_prefill_chunks_without_the_cpp_prefill_kernel_keep_the_eager_layers(
    model_dirs: dict[str, Path],
) -> None:
    executor = make_executor(model_dirs["llama"], native_prefill=False)
    _, calls = mixed_logits(executor)
    assert calls == 0
    _, calls = decode_logits(executor, steps=1)  # its decode step still fused
    assert calls == 1


def test_the_default_cpu_stack_runs_the_fused_step(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No station named: on a CPU the machine's defaults (the torch executor, the cpu attention
    # backend) put the steps of a generation on the fused step.
    from brigade import LLM, SamplingParams

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    directory = model_dirs["llama"]
    llm = LLM(overrides=[f"model.path={directory}", "kv.page_size=4", "kv.num_pages=64"])
    assert llm.config.plugin("attention") == "cpu"
    with counting_fused_calls() as calls:
        outputs = llm.generate([[5, 9, 13], [7, 2]], SamplingParams(max_tokens=4))
    assert [len(output.outputs[0].token_ids) for output in outputs] == [4, 4]
    # the prefill and three decode steps (at least: the engine may split them further)
    assert calls[0] >= 4, "the fused step did not run"
