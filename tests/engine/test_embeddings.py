"""Embeddings through the engine: last-token and mean pooling of the final hidden states equal
transformers' ``hidden_states[-1]``, however the prompts are chunked, batched with generation,
cached or preempted; requests that cannot be pooled fail alone and clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import GREEDY, assert_same_greedy, make_llm, prompts, run

from brigade import SamplingParams
from brigade.errors import RequestError
from brigade.interfaces import PoolingParams, Request
from brigade.models.create import create_model
from brigade.persistent_batch import PooledChunk

ATOL = 1e-5
"""fp32, unit vectors of the tiny models: brigade vs transformers differ by ~1e-7."""
ARCHS = ("llama", "mistral", "qwen2", "qwen3")
LAST, MEAN = PoolingParams(), PoolingParams(mode="mean")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {a: create_model(root / a, a, overrides={"num_hidden_layers": 2}) for a in ARCHS}


def reference_embeddings(model_dir: Path, token_prompts: list[list[int]]) -> dict[str, list]:
    """transformers' final hidden states, pooled and normalized: {"last": [...], "mean": [...]}."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    pooled: dict[str, list] = {"last": [], "mean": [], "raw_last": []}
    with torch.no_grad():
        for prompt in token_prompts:
            out = model(torch.tensor([prompt]), output_hidden_states=True)
            states = out.hidden_states[-1][0]  # [T, hidden], after the final norm
            pooled["raw_last"].append(states[-1])
            pooled["last"].append(torch.nn.functional.normalize(states[-1], dim=0))
            pooled["mean"].append(torch.nn.functional.normalize(states.mean(dim=0), dim=0))
    return pooled


def assert_close(ours: list, theirs: list, label: str) -> None:
    for index, (vector, expected) in enumerate(zip(ours, theirs, strict=True)):
        assert vector.embedding is not None, f"{label}: prompt {index} failed: {vector.error}"
        got = torch.tensor(vector.embedding)
        assert got.shape == expected.shape, f"{label}: prompt {index}: shape {got.shape}"
        gap = float((got - expected).abs().max())
        assert gap < ATOL, f"{label}: prompt {index}: max difference {gap:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_last_and_mean_pooling_equal_transformers(arch: str, model_dirs: dict) -> None:
    model_dir = model_dirs[arch]
    # A 16-token budget splits the long prompts into chunks across steps.
    llm = make_llm(model_dir, "scheduler.max_num_batched_tokens=16")
    token_prompts = prompts([5, 23, 40, 1], seed=3)
    reference = reference_embeddings(model_dir, token_prompts)
    assert_close(llm.embed(token_prompts), reference["last"], f"{arch} last")
    assert_close(llm.embed(token_prompts, MEAN), reference["mean"], f"{arch} mean")
    raw = llm.embed(token_prompts, PoolingParams(normalize=False))
    assert_close(raw, reference["raw_last"], f"{arch} last, not normalized")
    assert llm.engine.num_steps > 2 * len(token_prompts), "the budget should have chunked"
    assert not llm.engine.requests, "every embedding request left the engine"


def test_embeddings_batched_with_generation_change_neither(model_dirs: dict) -> None:
    model_dir = model_dirs["llama"]
    generate_prompts = prompts([7, 30, 12], seed=5)
    embed_prompts = prompts([33, 4, 19], seed=6)
    alone = run(make_llm(model_dir), generate_prompts)
    reference = reference_embeddings(model_dir, embed_prompts)
    llm = make_llm(model_dir, "scheduler.max_num_batched_tokens=16")
    engine = llm.engine
    for index, prompt in enumerate(generate_prompts):
        engine.add_request(f"g{index}", prompt, GREEDY)
    for index, prompt in enumerate(embed_prompts):
        pooling = LAST if index % 2 else MEAN
        admission = engine.admit(prompt, SamplingParams(max_tokens=1), pooling=pooling)
        engine.add_request(f"e{index}", prompt, admission.params, admission=admission)
    tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(len(generate_prompts))}
    logprobs: dict[str, list] = {key: [] for key in tokens}
    vectors: dict[str, list[float]] = {}
    mixed_steps = 0
    while engine.has_unfinished():
        updates = engine.step()
        kinds = {u.request.request_id[0] for u in updates}
        mixed_steps += kinds == {"g", "e"}
        for update in updates:
            assert update.error is None, update.error
            name = update.request.request_id
            if update.embedding is not None:
                assert update.finished
                assert not update.new_token_ids
                vectors[name] = update.embedding
            else:
                tokens[name].extend(update.new_token_ids)
                logprobs[name].extend(update.logprobs or [])
    assert mixed_steps, "no step carried both kinds of request"
    ours = [(tokens[f"g{i}"], logprobs[f"g{i}"]) for i in range(len(generate_prompts))]
    assert_same_greedy(ours, alone, "generation beside embeddings")
    for index, prompt in enumerate(embed_prompts):
        expected = reference["last" if index % 2 else "mean"][index]
        gap = float((torch.tensor(vectors[f"e{index}"]) - expected).abs().max())
        assert gap < ATOL, f"embedding {index} ({len(prompt)} tokens): difference {gap:.2e}"


def test_prefix_cache_serves_last_pooling_and_never_mean_pooling(model_dirs: dict) -> None:
    model_dir = model_dirs["qwen3"]
    shared = prompts([24], seed=7)[0]
    token_prompts = [shared + tail for tail in prompts([3, 6], seed=8)]
    reference = reference_embeddings(model_dir, token_prompts)
    llm = make_llm(model_dir)
    run(llm, [[*shared, 9]])  # the shared prefix is now cached
    hits = llm.engine.stats().prefix_cache_hits
    assert_close(llm.embed(token_prompts), reference["last"], "last, cached prefix")
    after_last = llm.engine.stats().prefix_cache_hits
    assert after_last > hits, "last pooling should reuse the cached prefix"
    assert_close(llm.embed(token_prompts, MEAN), reference["mean"], "mean, cached prefix")
    assert llm.engine.stats().prefix_cache_hits == after_last, "mean pooling matched the cache"


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_mean_pooling_still_equals_transformers(
    model_dirs: dict, preemption: str
) -> None:
    model_dir = model_dirs["mistral"]
    token_prompts = prompts([30, 22, 27, 18, 25], seed=9)
    reference = reference_embeddings(model_dir, token_prompts)
    llm = make_llm(
        model_dir,
        "kv.num_pages=16",  # 64 tokens: two of these prompts at most
        "kv.enable_prefix_caching=false",
        "scheduler.max_num_batched_tokens=8",
        f'scheduler.preemption="{preemption}"',
    )
    # Long generations hold pages while the embeddings' chunks need more: preemptions follow.
    for index, prompt in enumerate(prompts([12, 10], seed=10)):
        long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        llm.engine.add_request(f"gen{index}", prompt, long)
    preempted: set[str] = set()
    pool = llm.engine.pooler.add

    def add(chunk: PooledChunk, hidden: torch.Tensor) -> list[float] | None:
        if chunk.request.num_preemptions:
            preempted.add(chunk.request.request_id)
        return pool(chunk, hidden)

    llm.engine.pooler.add = add  # type: ignore[method-assign]
    assert_close(llm.embed(token_prompts, MEAN), reference["mean"], f"mean, {preemption}")
    assert preempted, "no embedding request was preempted mid-prompt"
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.kv.num_free_pages() == 16


def test_a_kv_manager_that_matches_a_mean_pooled_prompt_fails_it_alone(
    model_dirs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = model_dirs["llama"]
    shared = prompts([16], seed=11)[0]
    llm = make_llm(model_dir)
    run(llm, [[*shared, 5]])
    # A 2.0-era manager that ignores uses_prefix_cache matches the prompt anyway.
    monkeypatch.setattr(Request, "uses_prefix_cache", property(lambda self: True))
    bad, good = llm.embed([[*shared, 6, 7], prompts([9], seed=12)[0]], MEAN)
    assert bad.embedding is None
    assert bad.error is not None
    assert "prefix cache" in bad.error, bad.error
    assert good.embedding is not None
    assert good.error is None
    assert not llm.engine.requests


def test_embedding_requests_are_refused_clearly(
    model_dirs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = make_llm(model_dirs["llama"])
    with pytest.raises(RequestError, match="prompt 1: the prompt is empty"):
        llm.embed([[1, 2], []])
    with pytest.raises(ValueError, match="pooling mode 'max' is invalid"):
        PoolingParams(mode="max")
    from brigade.interfaces import StructuredOutput

    constrained = SamplingParams(structured_output=StructuredOutput("json"))
    with pytest.raises(RequestError, match="generates no text") as caught:
        llm.engine.admit([1, 2, 3], constrained, pooling=LAST)
    assert caught.value.param == "structured_output"
    assert llm.embed([[3, 4, 5]])[0].embedding is not None  # still serving
    monkeypatch.setattr(type(llm.engine.executor), "returns_hidden_states", False)
    with pytest.raises(RequestError, match="returns no hidden states") as caught:
        llm.embed([[3, 4, 5]])
    assert caught.value.param == "input"
