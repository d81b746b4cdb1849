"""The compiled CPU forward (``[executor] compile = true``, opt-in): it gives the eager
forward's outputs (which test_model_parity.py checks against transformers), compiles at start
rather than on the first request, leaves the KV pool clean, and falls back to eager with a
warning when compiling fails.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch._dynamo.exc
from executor_helpers import make_executor

from brigade import LLM, SamplingParams
from brigade.model_input import SeqChunk, build_model_input
from brigade.models.create import create_model
from brigade.testing.parity import assert_same_greedy_outputs

PAGE_SIZE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(
        tmp_path_factory.mktemp("compiled") / "qwen3", "qwen3", overrides={"num_hidden_layers": 2}
    )


def test_compiling_happens_at_start_and_leaves_the_pool_clean(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="brigade.plugins.executors.torch_executor"):
        executor = make_executor(model_dir, compiled=True)
    assert "compiled the forward in" in caplog.text
    assert executor.compiled is not None
    assert executor.compiled.failed is None
    assert executor._unzeroed is None  # the pool was zeroed at start ([executor] kv_prefault)
    for key_cache, value_cache in executor.kv_caches:
        assert not key_cache[0].any(), "the warm-up's page must be zeroed before a request uses it"
        assert not value_cache[0].any()
    # A request on page 0 right after the warm-up sees only its own keys.
    eager = make_executor(model_dir)
    batch = build_model_input([SeqChunk(list(range(3, 9)), 0, [0, 1], "all")], PAGE_SIZE)
    torch.testing.assert_close(executor.execute(batch), eager.execute(batch), atol=3e-5, rtol=0)


def test_a_failed_compile_falls_back_to_eager_with_a_warning(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    executor = make_executor(model_dir, compiled=True)
    compiled = executor.compiled
    assert compiled is not None

    def broken(*args: object) -> torch.Tensor:
        raise torch._dynamo.exc.TorchDynamoException("inductor: the C++ compiler is gone")

    compiled._compiled = broken
    batch = build_model_input([SeqChunk(list(range(5, 12)), 0, [2, 3], "all")], PAGE_SIZE)
    with caplog.at_level(logging.WARNING):
        logits = executor.execute(batch)
    assert "torch.compile failed, so the model runs eagerly" in caplog.text
    assert "the C++ compiler is gone" in caplog.text
    assert isinstance(compiled.failed, torch._dynamo.exc.TorchDynamoException)
    torch.testing.assert_close(logits, make_executor(model_dir).execute(batch), atol=3e-5, rtol=0)


def test_errors_that_are_not_compile_errors_still_raise(model_dir: Path) -> None:
    executor = make_executor(model_dir, compiled=True)
    assert executor.compiled is not None

    def buggy(*args: object) -> torch.Tensor:
        raise ValueError("a genuine bug")

    executor.compiled._compiled = buggy
    batch = build_model_input([SeqChunk([5, 6], 0, [2], "all")], PAGE_SIZE)
    with pytest.raises(ValueError, match="a genuine bug"):
        executor.execute(batch)
    assert executor.compiled.failed is None


def test_the_engine_generates_the_same_tokens_compiled_and_eager(model_dir: Path) -> None:
    settings = [f"model.path={model_dir}", "kv.page_size=8", "kv.num_pages=128"]
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 40, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    results = {}
    for compiled in (False, True):
        llm = LLM(overrides=[*settings, f"executor.compile={str(compiled).lower()}"])
        assert (llm.engine.executor.compiled is not None) == compiled  # type: ignore[attr-defined]
        outputs = llm.generate(prompts, params)
        results[compiled] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    assert_same_greedy_outputs(results[True], results[False], atol=1e-4, label="compiled")
