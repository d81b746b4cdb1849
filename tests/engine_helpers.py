"""Engine runs shared by the engine, swap and KV tests: an ``LLM`` on a created model with
small pages, seeded token prompts, greedy runs and their comparison."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from brigade import LLM, SamplingParams
from brigade.offline_replicas import ReplicaResult
from brigade.testing.parity import assert_same_greedy_outputs

LOGPROB_ATOL = 1e-4
"""Two brigade runs of one model: log probabilities of a near-tie."""


def make_llm(model_dir: Path, *settings: str) -> LLM:
    base = [f"model.path={model_dir}", "kv.page_size=4", "kv.num_pages=256", "model.dtype=float32"]
    return LLM(overrides=[*base, *settings])


def prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (n,), generator=generator).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def run(llm: LLM, token_prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    outputs = llm.generate(token_prompts, GREEDY)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def assert_same_greedy(ours: list, reference: list, label: str) -> None:
    assert_same_greedy_outputs(ours, reference, atol=LOGPROB_ATOL, label=label)


def assert_replicas_answer_as_one_engine(
    results: list[ReplicaResult], settings: list[str], prompts: list[str], params: SamplingParams
) -> None:
    """Every replica succeeded, and the answers in prompt order equal one local engine's."""
    assert all(r.error is None for r in results), [r.error for r in results]
    answers = {
        i: o.outputs[0].token_ids
        for r in results
        for i, o in zip(r.indices, r.outputs or [], strict=True)
    }
    reference = LLM(overrides=settings).generate(prompts, params, use_tqdm=False)
    assert [answers[i] for i in range(len(prompts))] == [o.outputs[0].token_ids for o in reference]
