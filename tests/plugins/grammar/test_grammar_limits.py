"""Structured output's cost bounds (issue "One small request must never stop the server").

A grammar whose masks grow past ``[grammar] mask_budget_ms`` fails its own request alone, as
a client error naming the limit; a late mask makes its row sit a step out without changing a
token while the other requests keep stepping; a grammar too large to send, too slow to compile
or too big once compiled is refused with the limit's name; a compile past its time limit or
one nobody waits for any more is stopped (its process killed); the compiled-grammar cache
stays within its bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from brigade import LLM
from brigade.engine import EngineCore, StepUpdate
from brigade.errors import RequestError
from brigade.interfaces import GrammarParams, SamplingParams, StructuredOutput
from brigade.models.checkpoint import open_checkpoint
from brigade.models.create import create_model
from brigade.plugins.grammar import compile_pool
from brigade.plugins.grammar.xgrammar import XGrammarBackend, XGrammarMatcher, XGrammarOptions
from brigade.registry import load_registry

ATTACK_REGEX = "(.{0,100}){0,100}zz"
"""88 bytes of request body that once froze every stream: each mask dearer than the last."""
SLOW_ENUM = {"enum": [f"value-{i}-xxxxx" for i in range(12000)]}
"""Compiles for many seconds on the tiny tokenizer (yet under the default size limit)."""
DIGITS = StructuredOutput("regex", "[0-9]{1,40}")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
FREE = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(tmp_path_factory.mktemp("limits") / "tiny", "llama")


class SlowMatcher(XGrammarMatcher):
    """Its masks take ``delays[i]`` seconds after ``i`` accepted tokens (0 past the list)."""

    delays: tuple[float, ...] = ()

    def __init__(self, inner: XGrammarMatcher) -> None:
        super().__init__(inner._matcher, inner._non_stop, inner._scratch)
        self.accepted = 0

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        if self.accepted < len(self.delays):
            time.sleep(self.delays[self.accepted])
        super().fill_bitmask(bitmask, index)

    def accept(self, token_id: int) -> bool:
        self.accepted += 1
        return super().accept(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.accepted -= num_tokens
        super().rollback(num_tokens)


def slow_llm(model_dir: Path, delays: tuple[float, ...], *settings: str) -> LLM:
    """An engine whose grammar masks are as slow as ``delays`` says."""

    class Slow(SlowMatcher):
        pass

    Slow.delays = delays

    class SlowBackend(XGrammarBackend):
        def matcher(self, compiled: Any) -> XGrammarMatcher:
            return Slow(super().matcher(compiled))

    registry = load_registry()
    registry.add("grammar", "slow", SlowBackend, options=XGrammarOptions)
    overrides = [*small_engine(model_dir), "grammar.plugin=slow", *settings]
    return LLM(overrides=overrides, registry=registry)


def small_engine(model_dir: Path) -> list[str]:
    return [f"model.path={model_dir}", "model.dtype=float32", "kv.page_size=4", "kv.num_pages=512"]


def run(engine: EngineCore, max_steps: int = 400) -> tuple[dict[str, list[StepUpdate]], int]:
    """Step until nothing is left: every request's updates, and the steps taken."""
    updates: dict[str, list[StepUpdate]] = {}
    for step in range(max_steps):
        if not engine.has_unfinished():
            return updates, step
        for update in engine.step():
            updates.setdefault(update.request.request_id, []).append(update)
    raise AssertionError(f"not finished after {max_steps} steps")


def tokens_of(updates: list[StepUpdate]) -> list[int]:
    return [token for update in updates for token in update.new_token_ids]


# -- the mask budget -------------------------------------------------------------------------


def test_a_grammar_whose_masks_grow_past_the_budget_fails_alone(model_dir: Path) -> None:
    reference = slow_llm(model_dir, ())
    expected = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, FREE)]
    # Masks 0, 1 and 2 are quick; mask 3 takes 0.4 s: past the 100 ms budget.
    llm = slow_llm(model_dir, (0.0, 0.0, 0.0, 0.4))
    engine = llm.engine
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"free-{index}", prompt, FREE)
    constrained = SamplingParams(max_tokens=12, temperature=0.0, structured_output=DIGITS)
    engine.add_request("slow", [20, 21, 22], constrained)
    updates, _ = run(engine)
    (last,) = [u for u in updates["slow"] if u.finished]
    assert last.error is not None
    assert "mask_budget_ms = 100" in last.error
    assert last.invalid, "the request's own grammar is at fault: a 400, not a 500"
    assert last.error_param == "structured_output"
    assert len(tokens_of(updates["slow"])) == 3  # the tokens its quick masks allowed
    for index in range(len(PROMPTS)):
        assert tokens_of(updates[f"free-{index}"]) == expected[index]
    assert engine.grammar is not None
    assert engine.grammar.num_over_budget == 1
    assert engine.dead is None


def test_a_late_mask_sits_the_step_out_and_changes_no_token(model_dir: Path) -> None:
    """Slower than the step's patience, faster than the budget: the constrained row waits
    for its mask while the free request takes a token every step."""
    prompt = [20, 21, 22]
    constrained = SamplingParams(max_tokens=12, temperature=0.0, structured_output=DIGITS)
    reference = slow_llm(model_dir, ())
    expected = reference.generate([prompt], constrained)[0].outputs[0].token_ids
    # Masks of 0.3 s, the first one included (its prompt's last token is computed again):
    # far past any step's patience, well within a 2 s budget.
    llm = slow_llm(model_dir, (0.3,) * 12, "grammar.mask_budget_ms=2000")
    engine = llm.engine
    admission = engine.admit(prompt, constrained)
    assert admission.grammar is not None
    admission.grammar.result(timeout=120)  # compiled: both requests run from the first step
    free = engine.add_request("free", PROMPTS[0], SamplingParams(max_tokens=10**4, ignore_eos=True))
    engine.add_request("late", prompt, constrained, admission=admission)
    late_tokens: list[int] = []
    step = 0
    while "late" in engine.requests:
        step += 1
        assert step < 10**4, "the late request never finished"
        free_runs, before = "free" in engine.requests, len(free.output_token_ids)
        for update in engine.step():
            if update.request.request_id == "late":
                late_tokens.extend(update.new_token_ids)
                assert update.error is None, update.error
        if free_runs:  # until it fills the context
            assert len(free.output_token_ids) == before + 1, f"step {step}: the free row waited"
    engine.abort_request("free")
    assert late_tokens == expected
    assert engine.grammar is not None
    assert engine.grammar.num_late > 0
    assert engine.grammar.num_over_budget == 0


def test_the_attack_regex_fails_its_request_alone(model_dir: Path) -> None:
    """The 88-byte regex of the attack: refused at compile time when its first mask is
    already too slow, else failed by the budget a few tokens in; never anyone else."""
    llm = LLM(overrides=small_engine(model_dir))
    engine = llm.engine
    attack = SamplingParams(
        max_tokens=64, temperature=0.0, structured_output=StructuredOutput("regex", ATTACK_REGEX)
    )
    engine.add_request("free", PROMPTS[0], FREE)
    try:
        engine.add_request("attack", PROMPTS[1], attack)
    except RequestError as refused:  # compiled (and probed) already: refused at once
        error = str(refused)
    else:
        updates, _ = run(engine)
        (last,) = [u for u in updates["attack"] if u.finished]
        assert last.invalid
        assert last.error is not None
        error = last.error
        assert len(tokens_of(updates["free"])) == FREE.max_tokens
    assert "mask_budget_ms = 100" in error
    assert engine.dead is None
    assert llm.generate([PROMPTS[2]], FREE)[0].outputs[0].finish_reason == "length"


# -- compile limits --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params(model_dir: Path) -> GrammarParams:
    checkpoint = open_checkpoint(str(model_dir))
    return GrammarParams(
        checkpoint.config["vocab_size"], (2,), "cpu", checkpoint=checkpoint, mask_budget_s=0.1
    )


@pytest.fixture
def backend_with(params: GrammarParams) -> Iterator[Any]:
    backends: list[XGrammarBackend] = []

    def make(**options: Any) -> XGrammarBackend:
        backends.append(XGrammarBackend(params, XGrammarOptions(**options)))
        return backends[-1]

    yield make
    for backend in backends:
        backend.shutdown()


def compiles_running() -> int:
    """Compile processes alive under this process's compile server."""
    server = compile_pool._server
    if server is None or not server.alive:
        return 0
    return len(psutil.Process(server.process.pid).children())


def wait_for_no_compiles(timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while compiles_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert compiles_running() == 0, "a compile process outlived its compile"


def test_a_grammar_over_the_size_limit_is_refused_before_compiling(backend_with: Any) -> None:
    backend = backend_with(max_grammar_bytes=4096)
    spec = StructuredOutput("json_schema", json.dumps({"enum": ["x" * 10] * 500}))
    future = backend.compile(spec)
    assert future.done(), "refused at once, without a compile"
    with pytest.raises(ValueError, match=r"more than \[grammar\] max_grammar_bytes = 4096"):
        future.result()
    assert backend.num_compiled == 0


def test_a_compile_past_its_time_limit_is_refused_and_stopped(backend_with: Any) -> None:
    backend = backend_with(compile_timeout_s=1.0)
    started = time.monotonic()
    future = backend.compile(StructuredOutput("json_schema", json.dumps(SLOW_ENUM)))
    with pytest.raises(ValueError, match=r"compile_timeout_s = 1\b"):
        future.result(timeout=60)
    assert time.monotonic() - started < 30
    wait_for_no_compiles()
    # The refusal is cached: the same grammar again fails at once, compiling nothing.
    compiled = backend.num_compiled
    with pytest.raises(ValueError, match="compile_timeout_s"):
        backend.compile(StructuredOutput("json_schema", json.dumps(SLOW_ENUM))).result(timeout=1)
    assert backend.num_compiled == compiled


def test_a_compile_nobody_waits_for_is_stopped(backend_with: Any) -> None:
    backend = backend_with(compile_timeout_s=600.0)
    spec = StructuredOutput("json_schema", json.dumps(SLOW_ENUM))
    first, second = backend.compile(spec), backend.compile(spec)
    deadline = time.monotonic() + 30
    while not compiles_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert compiles_running() == 1, "one compile for both callers"
    assert first.cancel()
    time.sleep(0.3)
    assert compiles_running() == 1, "the other caller still waits: the compile goes on"
    assert second.cancel()
    wait_for_no_compiles()
    assert not backend._cache, "a cancelled compile is not cached"


def test_a_request_that_leaves_while_its_grammar_compiles_stops_it(model_dir: Path) -> None:
    llm = LLM(overrides=small_engine(model_dir))
    engine = llm.engine
    slow = SamplingParams(
        max_tokens=8, structured_output=StructuredOutput("json_schema", json.dumps(SLOW_ENUM))
    )
    request = engine.add_request("leaves", PROMPTS[0], slow)
    assert request.status.name == "WAITING_FOR_GRAMMAR"
    deadline = time.monotonic() + 30
    while not compiles_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert compiles_running() == 1
    assert engine.abort_request("leaves") is request
    wait_for_no_compiles()
    assert not engine.has_unfinished()


def test_the_compiled_grammar_cache_stays_within_its_bytes(backend_with: Any) -> None:
    backend = backend_with(cache_mib=1)
    sizes = []
    for count in range(6):
        schema = {"enum": [f"choice-{count}-{i}" for i in range(1500)]}
        compiled = backend.compile(StructuredOutput("json_schema", json.dumps(schema))).result(60)
        sizes.append(compiled.memory_size_bytes)
        assert backend._cached_bytes <= backend.cache_bytes
    assert sum(sizes) > backend.cache_bytes, "the grammars together exceed the cache"
    assert len(backend._cache) < 6, "older grammars were evicted"


def test_a_grammar_larger_than_the_cache_is_refused(backend_with: Any) -> None:
    backend = backend_with(cache_mib=1)
    schema = {"enum": [f"choice-{i}" for i in range(10000)]}
    with pytest.raises(ValueError, match=r"more than \[grammar\] cache_mib = 1 allows"):
        backend.compile(StructuredOutput("json_schema", json.dumps(schema))).result(60)
