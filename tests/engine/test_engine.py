"""The engine loop end to end on CPU: parity with transformers, invariance of greedy output
under batching, chunking, prefix caching and preemption, and the offline API."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import GREEDY, assert_same_greedy, make_llm, prompts, run

from brigade import SamplingParams
from brigade.errors import RequestError
from brigade.models.create import create_model
from brigade.testing.parity import assert_greedy_match, reference_greedy

ATOL = 1e-4
"""fp32 logits of the tiny models (std ~4): brigade vs transformers differ by ~1e-5."""
ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {a: create_model(root / a, a, overrides={"num_hidden_layers": 2}) for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_on_a_mixed_batch(arch: str, model_dirs: dict) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs[arch]
    # A 16-token budget mixes prefill chunks with decodes; 4-token pages cross boundaries.
    llm = make_llm(model_dir, "scheduler.max_num_batched_tokens=16")
    token_prompts = prompts([5, 23, 40, 2])
    ours = llm.generate(token_prompts, GREEDY)
    reference = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    distinct = set()
    for prompt, result in zip(token_prompts, ours, strict=True):
        theirs, score = reference_greedy(reference, prompt, GREEDY.max_tokens)
        distinct.update(theirs)
        assert_greedy_match(result.outputs[0].token_ids, theirs, score, atol=ATOL, label=arch)
    assert len(distinct) >= 8, f"uninformative continuations: {distinct}"
    assert llm.engine.num_steps > GREEDY.max_tokens, "the budget should have forced chunking"


def test_batching_chunking_and_prefix_caching_do_not_change_tokens(model_dirs: dict) -> None:
    model_dir = model_dirs["llama"]
    shared = prompts([24])[0]
    token_prompts = [shared + p for p in prompts([3, 9, 1], seed=1)] + prompts([17, 6], seed=2)
    baseline = make_llm(model_dir, "kv.enable_prefix_caching=false")
    alone = [run(baseline, [p])[0] for p in token_prompts]
    variants = {
        "batch of many": [],
        "no chunked prefill": ["scheduler.enable_chunked_prefill=false"],
        "tiny token budget": ["scheduler.max_num_batched_tokens=8"],
        "prefix caching": ["kv.enable_prefix_caching=true"],
    }
    for label, settings in variants.items():
        llm = make_llm(model_dir, "kv.enable_prefix_caching=false", *settings)
        assert_same_greedy(run(llm, token_prompts), alone, label)
    cached = make_llm(model_dir)
    run(cached, token_prompts)
    again = run(cached, token_prompts)  # every prompt now hits the cache
    assert_same_greedy(again, alone, "cache hits")
    stats = cached.engine.stats()
    assert stats.prefix_cache_hits > len(shared), stats
    assert 0 < stats.prefix_hit_rate < 1
    assert stats.mean_queue_time_s >= 0


def test_a_pool_too_small_for_the_batch_still_finishes_everything(model_dirs: dict) -> None:
    model_dir = model_dirs["qwen3"]
    token_prompts = prompts([14, 9, 20, 11, 5, 16], seed=3)
    roomy = run(make_llm(model_dir), token_prompts)
    # 16 pages of 4 tokens: about two of these sequences at once.
    small = make_llm(model_dir, "kv.num_pages=16", "kv.enable_prefix_caching=false")
    assert_same_greedy(run(small, token_prompts), roomy, "small pool")
    assert small.engine.scheduler.stats().num_preemptions > 0
    assert small.engine.kv.num_free_pages() == 16


def test_offline_api_text_prompts_stop_strings_and_seeds(model_dirs: dict) -> None:
    llm = make_llm(model_dirs["llama"])
    # the offline step budget (the server's is 128 requests, 2048 tokens), unless set
    params = llm.engine.scheduler.params
    assert (params.max_num_seqs, params.max_num_batched_tokens) == (256, 4096)
    assert len(llm.engine.batch.temperature) == 256
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    [full] = llm.generate("Once upon a time", greedy)
    text = full.outputs[0].text
    assert full.prompt == "Once upon a time"
    assert text
    stop = text[5:8]
    [stopped] = llm.generate(
        "Once upon a time",
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,)),
    )
    out = stopped.outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert len(out.token_ids) < 16
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=3, ignore_eos=True)
    [first] = llm.generate([5, 6, 7], seeded)
    texts = [o.token_ids for o in first.outputs]
    assert len({tuple(t) for t in texts}) > 1, "children with seeds 7, 8, 9 should differ"
    # Same seed, same tokens, whatever else is in the batch.
    others = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    mixed = llm.generate([[9, 9, 9], [5, 6, 7], [1, 2]], [others, seeded, others])
    assert [o.token_ids for o in mixed[1].outputs] == texts
    assert all(o.finish_reason == "length" for o in first.outputs)


def test_bad_requests_fail_clearly_and_the_engine_keeps_serving(model_dirs: dict) -> None:
    llm = make_llm(model_dirs["llama"], "model.max_model_len=64")
    with pytest.raises(RequestError, match="prompt 1: prompt token id 99999 is outside"):
        llm.generate([[1, 2], [99999]], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="at most 63 prompt tokens"):
        llm.generate([list(range(5, 70))], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="logit_bias token id 5000"):
        llm.generate([[1]], SamplingParams(max_tokens=2, logit_bias={5000: 1.0}))
    assert not llm.engine.has_unfinished()
    [ok] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=70, ignore_eos=True))
    assert ok.outputs[0].finish_reason == "length"
    assert len(ok.outputs[0].token_ids) == 64 - 3, "generation stops at max_model_len"
