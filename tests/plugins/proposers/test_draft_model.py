"""The draft-model proposer: a second model with the served model's tokenizer drafts greedily
from a KV pool of its own; output stays exactly the non-speculating engine's.

A draft model identical to the served one must have (nearly) every draft accepted: any slip in
its KV bookkeeping (positions, pages, drafts credited that the request never took) shows up as
rejected drafts long before it shows up in the output, which verification keeps exact anyway.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import assert_same_greedy, make_llm, prompts, run

from brigade import LLM, SamplingParams
from brigade.errors import ConfigError, ModelLoadError
from brigade.interfaces import DraftSlot, Request
from brigade.models.create import create_model
from brigade.plugins.proposers.draft_model import DraftModelProposer

SPECULATE = ("speculative.num_speculative_tokens=4", "speculative.max_tokens_per_step=64")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft-models")
    return {
        "target": create_model(root / "target", "llama", overrides={"num_hidden_layers": 2}),
        # Smaller, another architecture and other weights, the same tokenizer.
        "small": create_model(root / "small", "qwen2", seed=7, overrides={"num_hidden_layers": 1}),
        "other-tokenizer": create_model(
            root / "spm", "llama", tokenizer="spm", overrides={"num_hidden_layers": 1}
        ),
    }


def drafting(target: Path, draft: Path | str, *settings: str) -> LLM:
    return make_llm(
        target,
        "speculative.plugin=draft-model",
        f"speculative.model={draft}",
        *SPECULATE,
        *settings,
    )


def test_the_served_model_as_its_own_draft_has_its_drafts_accepted(
    models: dict[str, Path],
) -> None:
    """Several requests at once, one longer than a step's catch-up, then one that shares its
    prefix (found in the draft pool's prefix cache)."""
    token_prompts = prompts([5, 9, 23, 40])
    token_prompts.append([*token_prompts[3][:30], 7, 8, 9])
    reference = run(make_llm(models["target"]), token_prompts)
    llm = drafting(models["target"], models["target"], "speculative.max_prefill_tokens=16")
    outputs = run(llm, token_prompts[:4]) + run(llm, token_prompts[4:])
    assert_same_greedy(outputs, reference, "draft = target")
    stats = llm.engine.stats().speculative
    assert stats is not None
    assert stats.num_drafts >= 20, stats
    assert stats.num_accepted >= 0.97 * stats.num_drafts, stats
    draft_kv = llm.engine.speculation.proposer.draft.kv.stats()
    assert draft_kv.prefix_cache_hits > 0, draft_kv  # the shared prefix was not recomputed


def test_drafts_continue_the_tokens_the_request_has_whatever_it_took(
    models: dict[str, Path],
) -> None:
    """Driven by hand: each answer is the draft model's own greedy continuation of the
    request's tokens, after drafts were rejected (the K/V fed for them must not count), after
    steps it did not see, and for a new request under a reused id."""
    plain = make_llm(models["target"])
    llm = drafting(models["target"], models["target"])
    proposer = llm.engine.speculation.proposer

    def greedy(tokens: list[int], count: int) -> list[int]:
        params = SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True)
        return list(plain.generate([tokens], params)[0].outputs[0].token_ids)

    def draft(request: Request, count: int = 4) -> list[int]:
        (tokens,) = proposer.propose([DraftSlot(request, count)])
        assert list(tokens) == greedy(request.all_token_ids, count), request.all_token_ids
        return list(tokens)

    request = Request("r", prompts([13], seed=4)[0], SamplingParams(max_tokens=100))
    first = draft(request)
    # The first draft taken, the second rejected: the token sampled instead follows it.
    request.output_token_ids += [first[0], (first[1] + 1) % 1000]
    proposer.observe(request, 4, 1)
    second = draft(request)
    # Every draft taken, plus the token after them.
    request.output_token_ids += [*second, 17]
    proposer.observe(request, 4, 4)
    draft(request, 3)
    # Steps it never saw (decoded without drafts), then none at all since its last answer.
    request.output_token_ids += [21, 22, 23]
    third = draft(request, 2)
    # A draft rejected, then more tokens from steps it did not see.
    request.output_token_ids += [(third[0] + 1) % 1000, 31, 32, 33]
    draft(request, 4)
    proposer.remove(request)
    again = Request("r", prompts([7], seed=5)[0], SamplingParams(max_tokens=100))
    draft(again)


def test_a_smaller_draft_model_leaves_the_output_exact(models: dict[str, Path]) -> None:
    token_prompts = prompts([3, 17, 31], seed=1)
    reference = run(make_llm(models["target"]), token_prompts)
    llm = drafting(models["target"], models["small"])
    assert_same_greedy(run(llm, token_prompts), reference, "small draft")
    stats = llm.engine.stats().speculative
    assert stats is not None
    assert stats.num_drafts > 0
    assert stats.num_accepted < stats.num_drafts  # random weights: it guesses, and misses


def test_a_draft_pool_too_small_for_everyone_evicts_and_stays_exact(
    models: dict[str, Path],
) -> None:
    """8 pages of 4 tokens: requests longer than 32 tokens draft nothing, and requests take
    turns in the pool (the least recently drafted is evicted and catches up again)."""
    token_prompts = prompts([6, 11, 14, 20, 29], seed=2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = make_llm(models["target"]).generate(token_prompts, params)
    llm = drafting(
        models["target"], models["target"], "speculative.num_pages=8", "scheduler.max_num_seqs=2"
    )
    outputs = llm.generate(token_prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    stats = llm.engine.stats().speculative
    assert stats is not None
    assert stats.num_drafts > 0
    assert stats.num_accepted >= 0.97 * stats.num_drafts, stats


@pytest.mark.parametrize(
    "settings",
    [
        ("kv.num_pages=14", "kv.enable_prefix_caching=false"),
        ("kv.num_pages=14", "scheduler.preemption=swap"),
        ("kv.plugin=radix", "kv.page_size=1", "kv.num_pages=1024"),
    ],
    ids=["recompute", "swap", "radix"],
)
def test_preemption_and_the_radix_manager_keep_the_output(
    models: dict[str, Path], settings: tuple[str, ...]
) -> None:
    """The served model's pages come and go (preempted, swapped); the draft model's pool
    (here 14 pages too, or the radix manager's) follows its own requests."""
    token_prompts = prompts([14, 9, 20], seed=9)
    reference = run(make_llm(models["target"]), token_prompts)
    llm = drafting(models["target"], models["target"], *settings)
    assert_same_greedy(run(llm, token_prompts), reference, " ".join(settings))
    stats = llm.engine.stats()
    if "kv.num_pages=14" in settings:
        assert stats.num_preemptions > 0
    assert stats.speculative is not None
    assert stats.speculative.num_accepted >= 0.97 * stats.speculative.num_drafts > 0


def test_sampled_requests_and_n_greater_than_one_speculate(models: dict[str, Path]) -> None:
    """Seeded sampling reproduces itself with the draft model on; children of one prompt
    each get drafts."""
    llm = drafting(models["target"], models["target"])
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=11, n=3, ignore_eos=True)
    first = llm.generate(prompts([8], seed=3), params)
    second = llm.generate(prompts([8], seed=3), params)
    assert [c.token_ids for c in first[0].outputs] == [c.token_ids for c in second[0].outputs]
    assert len({tuple(c.token_ids) for c in first[0].outputs}) > 1
    stats = llm.engine.stats().speculative
    assert stats is not None
    assert stats.num_accepted > 0


def test_what_cannot_draft_is_refused_clearly(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs model ="):
        make_llm(models["target"], "speculative.plugin=draft-model")
    with pytest.raises(ConfigError, match="tokenizer is not the served model's"):
        drafting(models["target"], models["other-tokenizer"])
    with pytest.raises(ModelLoadError):
        drafting(models["target"], tmp_path / "missing")


def test_an_engine_that_fails_to_start_shuts_down_what_it_loaded(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proposer that fails after its draft model loaded: the served model's executor and
    the draft's are both shut down (tensor-parallel ranks, devices), not left behind."""
    from brigade.interfaces import NoOptions, ProposerParams
    from brigade.plugins.executors.torch_executor import TorchExecutor
    from brigade.registry import load_registry

    stopped: list[TorchExecutor] = []
    shutdown = TorchExecutor.shutdown

    def recording(self: TorchExecutor) -> None:
        stopped.append(self)
        shutdown(self)

    monkeypatch.setattr(TorchExecutor, "shutdown", recording)

    def failing(params: ProposerParams, options: NoOptions) -> DraftModelProposer:
        assert params.load_model is not None
        params.load_model(str(models["small"]))
        raise ConfigError("this proposer gives up")

    registry = load_registry()
    registry.add("proposer", "gives-up", failing)
    with pytest.raises(ConfigError, match="gives up"):
        LLM(
            overrides=[f"model.path={models['target']}", "speculative.plugin=gives-up"],
            registry=registry,
        )
    assert len(stopped) == 2
    assert [Path(e.params.model_path).name for e in stopped] == ["target", "small"]


def test_config_check_opens_the_draft_model_without_its_weights(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """``brigade config check`` (and engine start, before any weights load) refuses what
    loading the draft model would, and names the one it would load."""
    from brigade.config import check_config, load_config
    from brigade.registry import load_registry

    registry = load_registry()

    def check(*settings: str) -> list[str]:
        overrides = [f"model.path={models['target']}", "speculative.plugin=draft-model"]
        return check_config(
            load_config(None, registry, overrides=[*overrides, *settings]), registry
        )

    notes = check(f"speculative.model={models['small']}")
    assert any(note.startswith("draft model: small") for note in notes), notes
    with pytest.raises(ConfigError, match="needs model ="):
        check()
    with pytest.raises(ConfigError, match="tokenizer is not the served model's"):
        check(f"speculative.model={models['other-tokenizer']}")
    with pytest.raises(ModelLoadError, match=r"\[speculative\] model .*missing"):
        check(f"speculative.model={tmp_path / 'missing'}")
    with pytest.raises(ConfigError, match="tensor parallelism"):
        check(f"speculative.model={models['small']}", "executor.tensor_parallel_size=2")
