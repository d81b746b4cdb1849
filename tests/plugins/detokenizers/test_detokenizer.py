"""The ``incremental`` detokenizer: conformance, UTF-8 safety, stop strings, random text."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brigade.interfaces import Request, SamplingParams, TextDelta
from brigade.models.create import create_model
from brigade.plugins.detokenizers.incremental import (
    IncrementalDetokenizer,
    IncrementalDetokenizerOptions,
)
from brigade.testing.conformance.detokenizer import check_detokenizer

ALPHABET = (
    "abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 .,:;!?-'\"\n\t"
    "éèêëüöäñçÆøßœ—€½"
    "你好世界日本語テキスト한국어"
    "🎉🦀😀👩\u200d💻❤️"
)
"""ASCII, accents and symbols, CJK, emoji (with a zero-width joiner and a variation selector)."""


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    model_dir = create_model(tmp_path_factory.mktemp("detokenizer") / "llama", "llama")
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def detokenizer(tokenizer: Any) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, IncrementalDetokenizerOptions())


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def request(tokenizer: Any, prompt: str = "Say something:", **params: Any) -> Request:
    return Request("r", encode(tokenizer, prompt), SamplingParams(**params))


def feed(
    detokenizer: IncrementalDetokenizer, req: Request, chunks: list[list[int]]
) -> list[TextDelta]:
    """Deltas of every step, then of finish."""
    state = detokenizer.start(req)
    deltas = [detokenizer.step(state, chunk) for chunk in chunks]
    return [*deltas, detokenizer.finish(state)]


def one_by_one(ids: list[int]) -> list[list[int]]:
    return [[token] for token in ids]


def test_incremental_detokenizer_conforms(tokenizer: Any) -> None:
    check_detokenizer(IncrementalDetokenizer, IncrementalDetokenizerOptions(), tokenizer)


def test_emoji_split_over_byte_tokens_leaves_whole_once_complete(
    tokenizer: Any, detokenizer: IncrementalDetokenizer
) -> None:
    ids = encode(tokenizer, "ok 🦀")
    assert len(ids) >= 3, "the emoji should span several byte-level tokens"
    deltas = feed(detokenizer, request(tokenizer), one_by_one(ids))
    texts = [delta.text for delta in deltas]
    assert "".join(texts) == "ok 🦀"
    assert texts[-2] == "🦀"  # the whole character, from the id that completes it
    assert all("\ufffd" not in text for text in texts)
    assert "".join(texts[:-2]) == "ok "  # the pieces before it gave no partial character


def test_stop_split_across_two_tokens_is_neither_leaked_nor_missed(
    tokenizer: Any, detokenizer: IncrementalDetokenizer
) -> None:
    ids = encode(tokenizer, "Hello world")
    assert tokenizer.convert_ids_to_tokens(ids) == ["Hello", "Ġworld"]
    first, second, last = feed(detokenizer, request(tokenizer, stop=("lo w",)), one_by_one(ids))
    assert first == TextDelta("Hel")  # "lo" could begin the stop: held back
    assert second == TextDelta("", stop_reason="lo w", num_tokens_to_stop=2)
    assert last == TextDelta("")


def test_stop_kept_in_output_when_asked(
    tokenizer: Any, detokenizer: IncrementalDetokenizer
) -> None:
    ids = encode(tokenizer, "Hello world, and more")
    req = request(tokenizer, stop=("lo w",), include_stop_str_in_output=True)
    deltas = feed(detokenizer, req, [ids])
    assert deltas[0] == TextDelta("Hello w", stop_reason="lo w", num_tokens_to_stop=2)
    assert deltas[1] == TextDelta("")


def test_held_back_text_is_released_when_the_match_fails(
    tokenizer: Any, detokenizer: IncrementalDetokenizer
) -> None:
    ids = encode(tokenizer, "Hello world")
    deltas = feed(detokenizer, request(tokenizer, stop=("lo there",)), one_by_one(ids))
    assert [delta.text for delta in deltas] == ["Hel", "lo world", ""]
    assert all(delta.stop_reason is None for delta in deltas)


def test_stop_prefix_at_the_end_is_flushed_by_finish(
    tokenizer: Any, detokenizer: IncrementalDetokenizer
) -> None:
    ids = encode(tokenizer, "Hello")
    deltas = feed(detokenizer, request(tokenizer, stop=("lo there",)), one_by_one(ids))
    assert [delta.text for delta in deltas] == ["Hel", "lo"]


def test_prompt_ending_inside_a_character_is_not_used_as_context(
    tokenizer: Any, detokenizer: IncrementalDetokenizer
) -> None:
    ids = encode(tokenizer, "abc 🦀 ok")
    split = 3  # the prompt ends after the emoji's first byte token
    assert tokenizer.decode(ids[:split]).endswith("\ufffd")
    req = Request("r", ids[:split], SamplingParams())
    deltas = feed(detokenizer, req, one_by_one(ids[split:]))
    assert "".join(delta.text for delta in deltas) == tokenizer.decode(ids[split:])


def test_bytes_that_never_form_a_character_keep_the_window_small(
    tokenizer: Any, detokenizer: IncrementalDetokenizer
) -> None:
    continuation_byte = tokenizer.convert_tokens_to_ids("Ģ")  # 0x80 alone is never valid
    ids = encode(tokenizer, "a") + [continuation_byte] * 200 + encode(tokenizer, " b")
    state = detokenizer.start(request(tokenizer))
    texts = []
    for token in ids:
        texts.append(detokenizer.step(state, [token]).text)
        assert len(state.tokens) - state.prefix_offset <= 24  # decoded per step
    texts.append(detokenizer.finish(state).text)
    assert "".join(texts) == tokenizer.decode(ids)


def test_special_tokens_are_skipped_unless_asked(
    tokenizer: Any, detokenizer: IncrementalDetokenizer
) -> None:
    ids = [1, *encode(tokenizer, "Hi"), 3, 0]
    skipped = feed(detokenizer, request(tokenizer), one_by_one(ids))
    kept = feed(detokenizer, request(tokenizer, skip_special_tokens=False), one_by_one(ids))
    assert "".join(delta.text for delta in skipped) == "Hi"
    assert "".join(delta.text for delta in kept) == "<|begin_of_text|>Hi<|im_end|><|endoftext|>"


@st.composite
def generations(draw: st.DrawFn) -> tuple[str, list[int]]:
    """Random text and chunk sizes that cover the whole text's ids (sizes may overshoot)."""
    text = draw(st.text(alphabet=ALPHABET, min_size=1, max_size=40))
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=80))
    return text, sizes


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    chunks, position = [], 0
    for size in sizes * (len(ids) // len(sizes) + 1):
        if position >= len(ids):
            break
        chunks.append(ids[position : position + size])
        position += size
    return chunks


@settings(max_examples=150, deadline=None)
@given(generation=generations())
def test_random_text_in_random_chunks_decodes_exactly(
    tokenizer: Any, detokenizer: IncrementalDetokenizer, generation: tuple[str, list[int]]
) -> None:
    text, sizes = generation
    ids = encode(tokenizer, text)
    deltas = feed(detokenizer, request(tokenizer), chunked(ids, sizes))
    assert "".join(delta.text for delta in deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in delta.text for delta in deltas)


@settings(max_examples=150, deadline=None)
@given(generation=generations(), data=st.data())
def test_random_stop_string_cuts_at_its_first_generated_occurrence(
    tokenizer: Any,
    detokenizer: IncrementalDetokenizer,
    generation: tuple[str, list[int]],
    data: st.DataObject,
) -> None:
    text, sizes = generation
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 6))]
    ids = encode(tokenizer, text)
    # The stop also sits in the prompt, which must not trigger it.
    req = request(tokenizer, prompt=f"Repeat {stop}:", stop=(stop,))
    deltas = feed(detokenizer, req, chunked(ids, sizes))
    first = text.find(stop)
    assert "".join(delta.text for delta in deltas) == text[:first]
    stopped = [delta for delta in deltas if delta.stop_reason is not None]
    assert len(stopped) == 1
    assert stopped[0].stop_reason == stop
    needed = next(
        n
        for n in range(len(ids) + 1)
        if tokenizer.decode(ids[:n]).startswith(text[: first + len(stop)])
    )
    assert stopped[0].num_tokens_to_stop == needed
