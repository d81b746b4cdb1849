"""Speculative decoding end to end: output is exactly the non-speculating engine's (greedy
tokens tie-aware, sampled distributions within sampling error), whatever the proposer guesses,
under chunked prefill, preemption, prefix caching and stops; the off-switches; a failing
proposer costs nothing but speed; config refuses what cannot speculate."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from engine_helpers import GREEDY, LOGPROB_ATOL, assert_same_greedy, make_llm, prompts, run

from brigade import LLM, SamplingParams
from brigade.errors import ConfigError
from brigade.interfaces import DraftSlot, NoOptions, Proposer, ProposerParams, Request
from brigade.models.create import create_model
from brigade.plugins.kv.paged import PagedKVManager, PagedKVOptions
from brigade.plugins.samplers.processors import LogitBiasProcessor
from brigade.registry import Registry, load_registry

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
Answers = dict[tuple[int, ...], list[int]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {a: create_model(root / a, a, overrides={"num_hidden_layers": 2}) for a in ARCHS}


class OracleProposer(Proposer):
    """Drafts what a reference run generated next (``shift`` > 0: a wrong token instead)."""

    def __init__(
        self, params: ProposerParams, options: NoOptions, answers: Answers, shift: int
    ) -> None:
        super().__init__(params, options)
        self.answers = answers
        self.shift = shift
        self.seen: list[str] = []

    def propose(self, slots: Sequence[DraftSlot]) -> list[list[int]]:
        drafts = []
        for slot in slots:
            request = slot.request
            self.seen.append(request.request_id)
            answer = self.answers.get(tuple(request.prompt_token_ids), [])
            if answer[: request.num_output_tokens] != request.output_token_ids:
                drafts.append([])  # off the reference path (a near-tie went the other way)
                continue
            start = request.num_output_tokens
            guess = answer[start : start + slot.max_tokens]
            drafts.append([(t + self.shift) % self.params.vocab_size for t in guess])
        return drafts


def registry_with(factory: Callable[[ProposerParams, NoOptions], Proposer]) -> Registry:
    registry = load_registry()
    registry.add("proposer", "test", factory)
    return registry


def oracle_llm(model_dir: Path, answers: Answers, *settings: str, shift: int = 0) -> LLM:
    registry = registry_with(
        lambda params, options: OracleProposer(params, options, answers, shift)
    )
    base = [f"model.path={model_dir}", "kv.page_size=4", "kv.num_pages=256", "model.dtype=float32"]
    spec = ["speculative.plugin=test", "speculative.max_tokens_per_step=64"]
    return LLM(overrides=[*base, *spec, *settings], registry=registry)


def answers_of(token_prompts: list[list[int]], outputs: list) -> Answers:
    return {tuple(p): list(tokens) for p, (tokens, _) in zip(token_prompts, outputs, strict=True)}


def assert_same_logprobs(ours: list, reference: list) -> None:
    """Where the tokens agree, the sampled tokens' log probabilities agree too."""
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, reference, strict=True):
        for token, ref_token, entry, ref_entry in zip(
            tokens, ref_tokens, logprobs, ref_logprobs, strict=False
        ):
            if token != ref_token:
                break
            assert math.isclose(entry.logprob, ref_entry.logprob, abs_tol=LOGPROB_ATOL)


def repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat a span, so prompt lookup has something to find."""
    spans = prompts([6, 9, 4, 11], seed=7)
    return [span * 3 + span[:2] for span in spans]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_the_same_whatever_the_proposer_guesses(
    arch: str, model_dirs: dict
) -> None:
    model_dir = model_dirs[arch]
    token_prompts = repetitive_prompts() + prompts([5, 23], seed=8)
    reference = run(make_llm(model_dir), token_prompts)
    answers = answers_of(token_prompts, reference)

    right = oracle_llm(model_dir, answers)
    ours = run(right, token_prompts)
    assert_same_greedy(ours, reference, f"{arch} right drafts")
    assert_same_logprobs(ours, reference)
    stats = right.engine.stats().speculative
    assert stats is not None
    assert stats.acceptance_rate > 0.9, stats
    assert stats.mean_accepted_length > 3, stats
    # 6 requests x 12 tokens in far fewer steps than one token per step would take
    assert right.engine.num_steps < GREEDY.max_tokens, right.engine.num_steps

    wrong = oracle_llm(model_dir, answers, shift=1)
    ours = run(wrong, token_prompts)
    assert_same_greedy(ours, reference, f"{arch} wrong drafts")
    assert_same_logprobs(ours, reference)
    stats = wrong.engine.stats().speculative
    assert stats is not None
    assert stats.num_drafts > len(token_prompts), stats
    assert stats.acceptance_rate < 0.05, stats

    ngram = make_llm(model_dir, "speculative.plugin=ngram", "speculative.max_tokens_per_step=64")
    assert_same_greedy(run(ngram, token_prompts), reference, f"{arch} ngram")


def test_chunking_preemption_and_prefix_caching_keep_the_output(model_dirs: dict) -> None:
    model_dir = model_dirs["llama"]
    token_prompts = repetitive_prompts() + prompts([14, 9, 20], seed=9)
    reference = run(make_llm(model_dir, "kv.enable_prefix_caching=false"), token_prompts)
    answers = answers_of(token_prompts, reference)
    variants = {
        "tiny token budget": ["scheduler.max_num_batched_tokens=8"],
        "small pool, recompute": ["kv.num_pages=14", "kv.enable_prefix_caching=false"],
        "small pool, swap": ["kv.num_pages=14", "scheduler.preemption=swap"],
        "radix": ["kv.plugin=radix", "kv.page_size=1", "kv.num_pages=1024"],
    }
    for label, settings in variants.items():
        for shift in (0, 1):
            llm = oracle_llm(model_dir, answers, *settings, shift=shift)
            assert_same_greedy(run(llm, token_prompts), reference, f"{label} shift {shift}")
            if "small pool" in label and shift == 0:
                assert llm.engine.stats().num_preemptions > 0, label
    # Rejected drafts' KV must never reach the prefix cache: run twice, the second from it.
    cached = oracle_llm(model_dir, answers, shift=1)
    run(cached, token_prompts)
    assert_same_greedy(run(cached, token_prompts), reference, "from the cache")
    assert cached.engine.stats().prefix_cache_hits > 0


def test_stops_and_limits_cut_accepted_drafts(model_dirs: dict) -> None:
    model_dir = model_dirs["qwen2"]
    token_prompts = repetitive_prompts()
    reference = run(make_llm(model_dir), token_prompts)
    answers = answers_of(token_prompts, reference)
    stop = reference[0][0][5]  # the first request stops there, others wherever it occurs
    for params in (
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop], logprobs=2),
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2),
    ):
        expected = make_llm(model_dir).generate(token_prompts, params)
        got = oracle_llm(model_dir, answers).generate(token_prompts, params)
        for ours, theirs in zip(got, expected, strict=True):
            assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
            assert ours.outputs[0].finish_reason == theirs.outputs[0].finish_reason
            assert len(ours.outputs[0].logprobs or []) == len(ours.outputs[0].token_ids)
        if params.stop_token_ids:
            assert len(got[0].outputs[0].token_ids) == 6
            assert got[0].outputs[0].finish_reason == "stop"


class TreeProposer(Proposer):
    """Drafts the most likely continuation of whatever a request generated so far."""

    def __init__(
        self, params: ProposerParams, options: NoOptions, best: dict[tuple[int, ...], int]
    ) -> None:
        super().__init__(params, options)
        self.best = best

    def propose(self, slots: Sequence[DraftSlot]) -> list[list[int]]:
        drafts = []
        for slot in slots:
            path = list(slot.request.output_token_ids)
            guess: list[int] = []
            while len(guess) < slot.max_tokens and tuple(path) in self.best:
                guess.append(self.best[tuple(path)])
                path.append(guess[-1])
            drafts.append(guess)
        return drafts


def test_sampling_at_temperature_one_keeps_the_distribution(model_dirs: dict) -> None:
    """3000 sampled 4-token continuations against the exact distribution of the top-3 tree."""
    model_dir = model_dirs["llama"]
    prompt = prompts([7], seed=11)[0]
    top_k, length, num_samples = 3, 4, 3000
    plain = make_llm(model_dir)

    def next_probs(prefix: tuple[int, ...]) -> dict[int, float]:
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=top_k, ignore_eos=True)
        entry = plain.generate([prompt + list(prefix)], params)[0].outputs[0].logprobs[0]
        table = dict(entry.top)
        total = sum(math.exp(v) for v in table.values())
        return {token: math.exp(v) / total for token, v in table.items()}

    exact: dict[tuple[int, ...], float] = {(): 1.0}
    best: dict[tuple[int, ...], int] = {}
    for _ in range(length):
        grown = {}
        for prefix, p in exact.items():
            probs = next_probs(prefix)
            best[prefix] = max(probs, key=probs.__getitem__)
            grown.update({(*prefix, token): p * q for token, q in probs.items()})
        exact = grown

    params = SamplingParams(max_tokens=length, temperature=1.0, top_k=top_k, ignore_eos=True)
    base = [f"model.path={model_dir}", "kv.page_size=4", "kv.num_pages=4096", "model.dtype=float32"]
    settings = [
        "scheduler.max_num_seqs=256",
        "speculative.max_batch_size=256",
        "speculative.max_tokens_per_step=4096",
    ]
    registry = registry_with(lambda params, options: TreeProposer(params, options, best))
    llm = LLM(overrides=[*base, *settings, "speculative.plugin=test"], registry=registry)
    outputs = llm.generate([prompt] * num_samples, params)
    counts = Counter(tuple(o.outputs[0].token_ids) for o in outputs)
    stats = llm.engine.stats().speculative
    assert stats is not None
    assert stats.accepted_by_position[1] > num_samples // 10, stats
    assert set(counts) <= set(exact), "a sequence outside the top-k tree"
    distance = 0.5 * sum(abs(counts[s] / num_samples - p) for s, p in exact.items())
    # Sampling error alone: E[TV] is at most 0.5 * sum(sqrt(p (1 - p) / n)).
    bound = 0.5 * sum(math.sqrt(p * (1 - p) / num_samples) for p in exact.values())
    assert distance < 1.5 * bound, (distance, bound)
    # Accepting drafts without checking them would pile the greedy path's mass far above it.
    greedy = max(exact, key=exact.__getitem__)
    share, p = counts[greedy] / num_samples, exact[greedy]
    assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / num_samples), (share, p)


def test_who_speculates(model_dirs: dict) -> None:
    model_dir = model_dirs["llama"]
    token_prompts = repetitive_prompts()
    reference = run(make_llm(model_dir), token_prompts)
    answers = answers_of(token_prompts, reference)
    proposers: list[OracleProposer] = []

    def factory(params: ProposerParams, options: NoOptions) -> OracleProposer:
        proposers.append(OracleProposer(params, options, answers, 0))
        return proposers[-1]

    base = [f"model.path={model_dir}", "kv.page_size=4", "model.dtype=float32"]
    # More requests running than max_batch_size: nobody speculates (they all finish together).
    llm = LLM(
        overrides=[*base, "speculative.plugin=test", "speculative.max_batch_size=3"],
        registry=registry_with(factory),
    )
    run(llm, token_prompts)
    assert proposers[-1].seen == [], "speculated in a batch larger than max_batch_size"
    # A request under a stage that depends on its tokens and cannot roll back never does.
    llm = LLM(overrides=[*base, "speculative.plugin=test"], registry=registry_with(factory))
    llm.engine.speculation.processors.append(NoRollback())  # type: ignore[union-attr]
    llm.generate(token_prompts, [GREEDY, GREEDY, GREEDY, GREEDY])
    seen = set(proposers[-1].seen)
    assert "0-0" not in seen, seen
    assert {"1-0", "2-0", "3-0"} <= seen, seen


class NoRollback(LogitBiasProcessor):
    """Depends on the tokens of the first request (request id 0-0) and cannot roll back."""

    def __init__(self) -> None:
        pass

    def is_position_independent(self, request: Request) -> bool:
        return request.request_id != "0-0"


def test_penalties_and_min_tokens_speculate_exactly(model_dirs: dict) -> None:
    """The sampling stage walks the penalties and min_tokens stages through the drafts."""
    model_dir = model_dirs["qwen3"]
    token_prompts = repetitive_prompts()
    eos = 5
    params = [
        dataclasses.replace(GREEDY, presence_penalty=0.8, frequency_penalty=0.5),
        dataclasses.replace(GREEDY, repetition_penalty=1.5),
        dataclasses.replace(GREEDY, min_tokens=8, stop_token_ids=[eos], ignore_eos=False),
        dataclasses.replace(GREEDY, logit_bias={eos: 3.0, 7: -2.0}),
    ]
    reference = [
        (o.outputs[0].token_ids, o.outputs[0].logprobs)
        for o in make_llm(model_dir).generate(token_prompts, params)
    ]
    answers = answers_of(token_prompts, reference)
    for shift in (0, 1):
        llm = oracle_llm(model_dir, answers, shift=shift)
        ours = [
            (o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(token_prompts, params)
        ]
        assert_same_greedy(ours, reference, f"penalties, shift {shift}")
        assert_same_logprobs(ours, reference)
        stats = llm.engine.stats().speculative
        assert stats is not None
        if shift == 0:
            assert stats.acceptance_rate > 0.9, stats
            assert llm.engine.num_steps < GREEDY.max_tokens, llm.engine.num_steps


class BrokenProposer(Proposer):
    """Fails each way the contract forbids, in turn."""

    def __init__(self, params: ProposerParams, options: NoOptions) -> None:
        super().__init__(params, options)
        self.calls = itertools.count()

    def propose(self, slots: Sequence[DraftSlot]) -> list[list[int]]:
        call = next(self.calls) % 4
        if call == 0:
            raise RuntimeError("proposer bug")
        if call == 1:
            return [[self.params.vocab_size + 5] for _ in slots]  # outside the vocabulary
        if call == 2:
            return [[1] * (slot.max_tokens + 1) for slot in slots]  # too many
        return [[1]]  # one list for many slots

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        raise RuntimeError("observe bug")


def test_a_failing_proposer_costs_speed_never_output(
    model_dirs: dict, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = model_dirs["mistral"]
    token_prompts = repetitive_prompts()
    reference = run(make_llm(model_dir), token_prompts)
    base = [f"model.path={model_dir}", "kv.page_size=4", "model.dtype=float32"]
    llm = LLM(overrides=[*base, "speculative.plugin=test"], registry=registry_with(BrokenProposer))
    with caplog.at_level(logging.ERROR):
        assert_same_greedy(run(llm, token_prompts), reference, "broken proposer")
    assert "the proposer 'test' failed" in caplog.text
    assert "proposer bug" in caplog.text
    stats = llm.engine.stats().speculative
    assert stats is not None
    assert stats.num_drafts == 0


class NoDraftsKV(PagedKVManager):
    """A KV manager that reserves no pages for draft tokens."""

    supports_draft_tokens = False


def test_config_refuses_what_cannot_speculate(model_dirs: dict) -> None:
    model_dir = model_dirs["llama"]
    registry = load_registry()
    registry.add("kv", "no-drafts", NoDraftsKV, options=PagedKVOptions)
    with pytest.raises(ConfigError, match="reserves no pages for draft tokens"):
        LLM(
            overrides=[
                f"model.path={model_dir}",
                "kv.plugin=no-drafts",
                "speculative.plugin=ngram",
            ],
            registry=registry,
        )
    # An executor that returns token ids verifies drafts with them (the simulator does).
    simulated = LLM(
        overrides=[
            f"model.path={model_dir}",
            "executor.plugin=simulated",
            "speculative.plugin=ngram",
        ]
    )
    assert simulated.engine.speculation is not None
    with pytest.raises(
        ConfigError, match="registered proposer plugins: draft-model, ngram, repeat-last, suffix"
    ):
        LLM(overrides=[f"model.path={model_dir}", "speculative.plugin=eagle"])
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(
            overrides=[
                f"model.path={model_dir}",
                "speculative.plugin=ngram",
                "speculative.num_speculative_tokens=0",
            ]
        )


def test_n_children_and_seeds_with_speculation(model_dirs: dict) -> None:
    """Children speculate like any request; a seeded request is reproducible with speculation
    on (its stream differs from the same seed without it: docs/speculative.md)."""
    model_dir = model_dirs["llama"]
    token_prompts = repetitive_prompts()[:2]
    greedy = dataclasses.replace(GREEDY, n=2)
    reference = make_llm(model_dir).generate(token_prompts, greedy)
    answers = {
        tuple(p): list(o.outputs[0].token_ids)
        for p, o in zip(token_prompts, reference, strict=True)
    }
    llm = oracle_llm(model_dir, answers)
    ours = llm.generate(token_prompts, greedy)
    for mine, theirs in zip(ours, reference, strict=True):
        assert [c.token_ids for c in mine.outputs] == [c.token_ids for c in theirs.outputs]
    stats = llm.engine.stats().speculative
    assert stats is not None
    assert stats.num_accepted > 0
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=3, ignore_eos=True)
    # repeat-last offers drafts at every step, so every step verifies some.
    spec = make_llm(
        model_dir, "speculative.plugin=repeat-last", "speculative.max_tokens_per_step=64"
    )
    first = [[c.token_ids for c in o.outputs] for o in spec.generate(token_prompts, seeded)]
    again = [[c.token_ids for c in o.outputs] for o in spec.generate(token_prompts, seeded)]
    assert first == again
    assert all(len({tuple(c) for c in children}) > 1 for children in first)
    stats = spec.engine.stats().speculative
    assert stats is not None
    assert stats.num_drafts > 2 * 3 * 8
