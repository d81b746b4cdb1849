"""Configured logits processors: ban-words, their place in the built-in samplers' chains, and
an engine that selects them in its config."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import faulty_plugins
import pytest
import torch
from server_harness import tiny_model

from brigade import LLM, SamplingParams
from brigade.assemble import build_sampler
from brigade.config import load_config
from brigade.errors import ConfigError
from brigade.interfaces import Checkpoint, LogitsProcessor, Request, SamplerParams
from brigade.models.checkpoint import open_checkpoint
from brigade.plugins.samplers.ban_words import BanWordsOptions, BanWordsProcessor
from brigade.plugins.samplers.processors import (
    LogitBiasProcessor,
    MinTokensProcessor,
    PenaltiesProcessor,
)
from brigade.plugins.samplers.standard import StandardSampler, StandardSamplerOptions
from brigade.registry import load_registry
from brigade.testing.conformance import check_logits_processor

VOCAB = 32
PARAMS = SamplerParams(max_num_seqs=8, vocab_size=VOCAB, device="cpu")


def request(output: Sequence[int] = (), **sampling: Any) -> Request:
    return Request(
        "r",
        [1, 2],
        SamplingParams(max_tokens=64, **sampling),
        eos_token_ids=frozenset({0}),
        output_token_ids=list(output),
    )


def step(processor: LogitsProcessor, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``begin_step`` then ``apply`` on a copy, as core calls them."""
    processor.begin_step(rows)
    return processor.apply(logits.clone(), torch.tensor(rows))


def run_chain(
    chain: Sequence[LogitsProcessor], logits: torch.Tensor, rows: list[int]
) -> torch.Tensor:
    logits = logits.clone()
    active = [p for p in chain if p.is_active]
    for processor in active:
        processor.begin_step(rows)
    for processor in active:
        logits = processor.apply(logits, torch.tensor(rows))
    return logits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("processors"))


@pytest.fixture(scope="module")
def checkpoint(model_dir: Path) -> Checkpoint:
    return open_checkpoint(str(model_dir))


# -- ban-words -------------------------------------------------------------------------


def test_ban_words_masks_token_ids_in_added_rows_only() -> None:
    ban = BanWordsProcessor(PARAMS, BanWordsOptions(token_ids=(3, 17)))
    assert not ban.is_active
    ban.add(2, request())
    ban.add(5, request())
    logits = torch.randn(3, VOCAB)
    out = step(ban, logits, [5, 0, 2])
    expected = logits.clone()
    expected[[0, 2]] = expected[[0, 2]].index_fill(1, torch.tensor([3, 17]), float("-inf"))
    assert torch.equal(out, expected)
    ban.remove(2)
    ban.remove(5)
    assert not ban.is_active


def test_ban_words_stops_a_word_of_several_tokens_at_its_last_token(
    checkpoint: Checkpoint,
) -> None:
    tokenizer = checkpoint.tokenizer()
    params = SamplerParams(8, checkpoint.config["vocab_size"], "cpu", checkpoint=checkpoint)
    ban = BanWordsProcessor(params, BanWordsOptions(words=("Sorry",)))
    written = tokenizer.encode("Sorry", add_special_tokens=False)
    spaced = tokenizer.encode(" Sorry", add_special_tokens=False)
    assert len(written) > 1
    assert len(spaced) > 1
    assert written != spaced
    logits = torch.zeros(1, params.vocab_size)
    ban.add(0, request())
    assert torch.equal(step(ban, logits, [0]), logits)  # nothing emitted yet: nothing to stop
    for token in spaced[:-1]:
        ban.accept_batch([0], [token])
    out = step(ban, logits, [0])
    assert out[0, spaced[-1]] == float("-inf")
    assert int(torch.isinf(out).sum()) == 1  # only the word's last token
    ban.accept_batch([0], [spaced[0]])  # the output no longer ends with the word's start
    assert torch.equal(step(ban, logits, [0]), logits)
    # Preempted and back, its emitted tokens ending with the word's start: still stopped.
    ban.remove(0)
    ban.add(4, request(output=[9, *written[:-1]]))
    assert step(ban, logits, [4])[0, written[-1]] == float("-inf")


def test_ban_words_refuses_what_it_cannot_ban() -> None:
    with pytest.raises(
        ValueError, match=r"ban-words holds token ids outside the vocabulary: \[32\]"
    ):
        BanWordsProcessor(PARAMS, BanWordsOptions(token_ids=(32,)))
    with pytest.raises(ValueError, match=r"need the model's tokenizer.*ban token_ids instead"):
        BanWordsProcessor(PARAMS, BanWordsOptions(words=("Sorry",)))
    with pytest.raises(ValueError, match="empty or blank"):
        BanWordsOptions(words=(" ",))


def test_ban_words_conforms(checkpoint: Checkpoint) -> None:
    check_logits_processor(BanWordsProcessor, BanWordsOptions(token_ids=(3, 5, 60)))
    options = BanWordsOptions(words=("Sorry", "zebra"), token_ids=(7,))
    check_logits_processor(
        BanWordsProcessor,
        options,
        vocab_size=checkpoint.config["vocab_size"],
        checkpoint=checkpoint,
    )


@pytest.mark.parametrize("stage", [LogitBiasProcessor, MinTokensProcessor, PenaltiesProcessor])
def test_the_standard_samplers_own_stages_conform(stage: type) -> None:
    check_logits_processor(lambda params, _: stage(params), None)


# -- the chain ---------------------------------------------------------------------------


def test_without_configured_processors_the_chain_gives_the_logits_it_gave_before() -> None:
    """min_tokens moved behind bias and penalties: masking commutes with both, so the logits
    are bit-for-bit those of the former order (min_tokens first)."""
    torch.manual_seed(0)
    requests = [
        request(min_tokens=4, stop_token_ids=(5,), logit_bias={5: 30.0, 6: -2.0}),
        request(output=[0, 5, 5], min_tokens=6, repetition_penalty=0.7, presence_penalty=0.5),
        request(min_tokens=2, frequency_penalty=-1.0, logit_bias={0: 100.0}),
        request(),
    ]
    former = (MinTokensProcessor(PARAMS), LogitBiasProcessor(PARAMS), PenaltiesProcessor(PARAMS))
    current = StandardSampler(PARAMS, StandardSamplerOptions()).logits_processors()
    assert [type(p) for p in current] == [
        LogitBiasProcessor,
        PenaltiesProcessor,
        MinTokensProcessor,
    ]
    rows = [6, 1, 3, 0]
    for chain in (former, current):
        for row, req in zip(rows, requests, strict=True):
            for processor in chain:
                processor.add(row, req)
    for step_index in range(3):
        logits = torch.randn(len(rows), VOCAB) * 4
        assert torch.equal(run_chain(former, logits, rows), run_chain(current, logits, rows))
        tokens = [(step_index + row) % 7 for row in rows]
        for chain in (former, current):
            for processor in chain:
                processor.accept_batch(rows, tokens)


@pytest.mark.parametrize(("factory", "options"), [(StandardSampler, StandardSamplerOptions())])
def test_a_request_cannot_bias_its_way_past_a_configured_ban(factory: Any, options: Any) -> None:
    ban = BanWordsProcessor(PARAMS, BanWordsOptions(token_ids=(4,)))
    params = SamplerParams(8, VOCAB, "cpu", logits_processors=(ban,))
    chain = factory(params, options).logits_processors()
    names = [type(p).__name__ for p in chain]
    expected = ["LogitBiasProcessor", "PenaltiesProcessor", "BanWordsProcessor"]
    assert names[:4] == [*expected, "MinTokensProcessor"]
    for processor in chain:
        processor.add(0, request(logit_bias={4: 100.0}))
    out = run_chain(chain, torch.zeros(1, VOCAB), [0])
    assert out[0, 4] == float("-inf")
    assert out[0].argmax() != 4


# -- an engine with configured processors --------------------------------------------------


def engine_overrides(model_dir: Path, *settings: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        "model.max_model_len=64",
        "kv.page_size=8",
        "kv.num_pages=32",
        *settings,
    ]


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [[5, 6, 7, 8]]


def test_an_engine_with_ban_words_never_emits_the_banned_tokens(model_dir: Path) -> None:
    plain = LLM(overrides=engine_overrides(model_dir)).generate(PROMPT, GREEDY)[0].outputs[0]
    banned = sorted(set(plain.token_ids[:3]))
    llm = LLM(
        overrides=engine_overrides(
            model_dir,
            'sampler.logits_processors=["ban-words"]',
            f"sampler.logits_processor_options={{ban-words = {{token_ids = {banned}}}}}",
        )
    )
    assert any(isinstance(p, BanWordsProcessor) for p in llm.engine.processors)
    biased = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=dict.fromkeys(banned, 100.0)
    )
    for params in (GREEDY, biased, SamplingParams(max_tokens=8, temperature=1.0, seed=3)):
        tokens = llm.generate(PROMPT, params)[0].outputs[0].token_ids
        assert len(tokens) == 8
        assert not set(tokens) & set(banned), (params, tokens)


def test_an_engine_refuses_a_sampler_that_drops_the_configured_processors(
    model_dir: Path,
) -> None:
    registry = load_registry()
    registry.add(
        "sampler",
        "blind",
        faulty_plugins.FieldBlindSampler,
        options=faulty_plugins.FieldBlindOptions,
    )
    overrides = [
        'sampler.plugin="blind"',
        'sampler.field="logits_processors"',
        'sampler.logits_processors=["ban-words"]',
    ]
    config = load_config(None, registry, overrides=overrides)
    with pytest.raises(ConfigError, match=r"sampler 'blind' does not apply .* ban-words"):
        build_sampler(config, registry, PARAMS)


def test_a_processor_that_cannot_start_with_this_model_is_a_config_error() -> None:
    registry = load_registry()
    overrides = [
        'sampler.logits_processors=["ban-words"]',
        "sampler.logits_processor_options={ban-words = {token_ids = [99]}}",
    ]
    config = load_config(None, registry, overrides=overrides)
    with pytest.raises(ConfigError, match=r"'ban-words' cannot start with this model: .*\[99\]"):
        build_sampler(config, registry, PARAMS)
