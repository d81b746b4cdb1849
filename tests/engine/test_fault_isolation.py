"""One bad request or one faulty plugin fails alone: the engine, in process, with plugins
that fail on purpose (tests/faulty_plugins.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import faulty_plugins
import pytest
from faulty_plugins import HOOK_POISON, POISON
from server_harness import tiny_model

from brigade import LLM, SamplingParams
from brigade.errors import EngineDeadError, RequestError, RequestFailedError
from brigade.registry import load_registry
from brigade.testing.parity import assert_same_greedy_outputs

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
NUM_PAGES = 96
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("faults"))


def faulty_llm(model_dir: Path, *settings: str) -> LLM:
    base = [
        f"model.path={model_dir}",
        "model.max_model_len=128",
        "kv.page_size=8",
        f"kv.num_pages={NUM_PAGES}",
    ]
    return LLM(overrides=[*base, *settings], registry=load_registry(plugins=[faulty_plugins]))


def outputs_of(results: list) -> list[tuple[list[int], list]]:
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    """The faulty sampler (it fails after 2 tokens) and scheduler (it cannot add priority 7)."""
    return faulty_llm(
        model_dir,
        "sampler.plugin=faulty",
        "sampler.fail_after_tokens=2",
        "scheduler.plugin=faulty",
        "scheduler.fail_add_priority=7",
    )


@pytest.fixture(scope="module")
def configured_llm(model_dir: Path) -> LLM:
    """The default sampler with the faulty processor configured as a logits_processor."""
    return faulty_llm(
        model_dir,
        'sampler.logits_processors=["faulty"]',
        "sampler.logits_processor_options={faulty = {fail_after_tokens = 2}}",
    )


@pytest.mark.parametrize("engine", ["llm", "configured_llm"])
@pytest.mark.parametrize("fail_in", list(POISON))
def test_a_request_a_logits_processor_fails_for_fails_alone(
    request: pytest.FixtureRequest, engine: str, fail_in: str
) -> None:
    """The faulty stage of a sampler plugin, or configured next to the built-in sampler."""
    llm: LLM = request.getfixturevalue(engine)
    results = llm.generate(PROMPTS, GREEDY, priority=[0, POISON[fail_in], 0])
    failed = results[1].outputs[0]
    assert failed.finish_reason == "error"
    assert failed.error is not None
    if fail_in == "nan_logits":
        assert "sampling distribution is undefined" in failed.error
    else:
        assert "FaultyProcessor" in failed.error
        assert "poisoned" in failed.error
    # It failed where it failed: never at admission, after its first tokens for all but add.
    assert len(failed.token_ids) == (0 if fail_in == "add" else 2)
    alone = llm.generate([PROMPTS[0], PROMPTS[2]], GREEDY)
    survivors = [results[0], results[2]]
    assert [r.outputs[0].finish_reason for r in survivors] == ["length", "length"]
    assert_same_greedy_outputs(
        outputs_of(survivors), outputs_of(alone), atol=LOGPROB_ATOL, label=fail_in
    )
    assert llm.engine.kv.num_free_pages() == NUM_PAGES, "the failed request's pages came back"
    assert not llm.engine.has_unfinished()


def test_seeded_neighbours_keep_their_tokens_when_a_processor_fails(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    results = llm.generate([PROMPTS[0], PROMPTS[1]], seeded, priority=[0, POISON["apply"]])
    assert results[1].outputs[0].finish_reason == "error"
    alone = llm.generate([PROMPTS[0]], seeded)
    assert results[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 3.5e38),
        ("temperature", 1e308),
        ("temperature", 2.66e270),
        ("repetition_penalty", 1e300),
        ("repetition_penalty", 1e-300),
        ("top_k", 10**30),
    ],
)
def test_sampling_parameters_float32_cannot_hold_are_refused_at_admission(
    llm: LLM, field: str, value: float
) -> None:
    params = SamplingParams(max_tokens=4, **{field: value})  # type: ignore[arg-type]
    with pytest.raises(RequestError) as refused:
        llm.engine.add_request("bad", PROMPTS[0], params)
    assert refused.value.param == field
    assert f"{field}=" in str(refused.value)
    assert not llm.engine.has_unfinished()
    # Nothing was queued: a normal request runs as if the bad one never came.
    assert llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].finish_reason == "length"


def test_a_scheduler_that_cannot_add_a_request_fails_only_that_one(llm: LLM) -> None:
    with pytest.raises(RequestFailedError, match="the scheduler 'faulty' failed to queue"):
        llm.engine.add_request("refused", PROMPTS[0], GREEDY, priority=7)
    assert "refused" not in llm.engine.requests
    assert llm.generate(PROMPTS, GREEDY)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("poisoned", [0, 2], ids=["at the head", "behind others"])
def test_a_policy_whose_peek_raises_for_one_request_fails_only_that_one(
    model_dir: Path, poisoned: int
) -> None:
    """Core finds the waiting request that makes ``peek`` raise (taking requests out,
    newest first, until it works) and fails it alone; the others keep their order."""
    llm = faulty_llm(model_dir, "scheduler.plugin=faulty", "scheduler.fail_peek_priority=9")
    prompts = [*PROMPTS, [17, 18, 19]]
    priorities = [0] * len(prompts)
    priorities[poisoned] = 9
    alone = llm.generate([p for i, p in enumerate(prompts) if i != poisoned], GREEDY)
    results = llm.generate(prompts, GREEDY, priority=priorities)
    failed = results[poisoned].outputs[0]
    assert failed.finish_reason == "error"
    assert failed.error is not None
    assert "the scheduler 'faulty' failed for this request: KeyError" in failed.error
    others = [r for i, r in enumerate(results) if i != poisoned]
    assert [r.outputs[0].finish_reason for r in others] == ["length"] * len(others)
    assert_same_greedy_outputs(
        outputs_of(others), outputs_of(alone), atol=LOGPROB_ATOL, label="beside a bad peek"
    )
    assert llm.engine.dead is None
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_pages() == NUM_PAGES


def test_a_policy_whose_peek_always_raises_still_kills_the_engine(model_dir: Path) -> None:
    """No request explains a policy that fails with an empty queue too: the engine dies
    visibly, as for any step that fails twice."""
    llm = faulty_llm(model_dir, "scheduler.plugin=faulty")
    policy = llm.engine.scheduler.policy

    def broken() -> None:
        raise RuntimeError("the policy is broken")

    policy.peek = broken  # type: ignore[method-assign]
    with pytest.raises(EngineDeadError, match="the policy is broken"):
        llm.generate(PROMPTS, GREEDY)


def test_a_step_that_fails_once_is_retried(model_dir: Path) -> None:
    llm = faulty_llm(
        model_dir,
        "scheduler.plugin=faulty",
        "scheduler.fail_schedule_priority=3",
        "scheduler.fail_schedule_times=1",
    )
    results = llm.generate(PROMPTS, GREEDY, priority=[3, 0, 0])
    assert [r.outputs[0].finish_reason for r in results] == ["length"] * 3
    assert llm.engine.dead is None


def test_a_step_that_fails_twice_kills_the_engine_visibly(model_dir: Path) -> None:
    llm = faulty_llm(model_dir, "scheduler.plugin=faulty", "scheduler.fail_schedule_priority=3")
    with pytest.raises(EngineDeadError, match="failed twice in a row: RuntimeError: the scheduler"):
        llm.generate(PROMPTS, GREEDY, priority=[0, 3, 0])
    assert llm.engine.dead is not None
    with pytest.raises(EngineDeadError):  # never a silent hang: every later step says so
        llm.engine.step()


def test_a_failing_finished_hook_changes_nothing(
    llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        results = llm.generate(PROMPTS, GREEDY, priority=[HOOK_POISON, 0, HOOK_POISON])
        # An abort (a stop string, a client gone) calls the hook too.
        request = llm.engine.add_request("aborted", PROMPTS[1], GREEDY, priority=HOOK_POISON)
        llm.engine.step()
        assert llm.engine.abort_request(request.request_id) is request
    assert [r.outputs[0].finish_reason for r in results] == ["length"] * 3
    assert "the brigade_request_finished hook" in caplog.text
    assert "faulty_plugins" in caplog.text  # names the plugin
    assert llm.engine.dead is None
    assert llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0].finish_reason == "length"
