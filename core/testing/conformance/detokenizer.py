"""Conformance of detokenizers: text deltas, UTF-8 safety, stop strings, special tokens.

The reference text of a generation is the text its ids add to the prompt's text,
``decode(prompt + ids)[len(decode(prompt)):]`` (for byte-level BPE tokenizers exactly
``decode(ids)``), decoded with the request's ``skip_special_tokens`` and without
``clean_up_tokenization_spaces``. Every check feeds the ids one at a time, in random chunks
and all at once.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from brigade.interfaces import Detokenizer, Request, SamplingParams, TextDelta

__all__ = ["DETOKENIZER_TEXTS", "check_detokenizer"]

DETOKENIZER_TEXTS: tuple[str, ...] = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Crème brûlée, naïve café, Ærøskøbing: ça va? Größe 5 µm, ½ € — “quoted”.",
    "日本語のテキスト、中文文本和한국어 텍스트。終わり",
    "Emoji: 🎉🦀👩‍💻 and a flag 🇫🇷, a heart ❤️ done 😀!",
    "  leading spaces\n\nblank lines\n\ttabs\t and trailing  \n",
    "def square(x):\n    return x ** 2  # 二乗\n",
)
"""Generations every detokenizer must reproduce: accents, CJK, emoji, whitespace, code."""

PROMPT_TEXT = "Question: what does the zebra say?\nAnswer:"
PROMPT_ONLY_STOP = "zebra"
NEVER_STOP = "\x07never\x07"
REPLACEMENT_CHAR = "\ufffd"

Factory = Callable[[Any, Any], Detokenizer]


def check_detokenizer(factory: Factory, options: Any, tokenizer: Any, *, seed: int = 0) -> None:
    """Check the detokenizer ``factory(tokenizer, options)`` builds on :data:`DETOKENIZER_TEXTS`.

    Without stops the deltas concatenate to the reference text, text leaves as soon as it is
    complete (one id at a time, what has left equals the reference so far without a trailing
    U+FFFD) and no delta holds U+FFFD the reference lacks. With stop strings (one, several, one
    a prefix of another, one split across ids, multi-byte, one that never appears, one in the
    prompt only) the output is the reference cut at the match that ends first, nothing of a
    stop leaks, the match is reported in the first call that has the ids it needs, with
    ``stop_reason`` and ``num_tokens_to_stop``, and every later call is empty. Both values of
    ``skip_special_tokens`` and two interleaved requests on one detokenizer are checked too.
    """
    detokenizer = factory(tokenizer, options)
    rng = random.Random(seed)
    prompt = list(tokenizer.encode(PROMPT_TEXT, add_special_tokens=False))
    specials = sorted(set(tokenizer.all_special_ids))
    for index, text in enumerate(DETOKENIZER_TEXTS):
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        variants = [("plain", ids)]
        if specials:
            variants.append(("special tokens", _with_specials(tokenizer, ids, specials)))
        for kind, variant in variants:
            for skip in (True, False):
                for prompt_name, prompt_ids in (("prompt", prompt), ("no prompt", [])):
                    label = f"text {index} ({kind}, skip_special_tokens={skip}, {prompt_name})"
                    refs = _prefix_references(tokenizer, prompt_ids, variant, skip)
                    _check_generation(detokenizer, prompt_ids, variant, refs, skip, rng, label)
        refs = _prefix_references(tokenizer, prompt, ids, True)
        for stops in _stop_cases(refs):
            for include in (False, True):
                label = f"text {index}, stop={stops}, include_stop_str_in_output={include}"
                params = SamplingParams(stop=stops, include_stop_str_in_output=include)
                _check_stops(detokenizer, prompt, ids, refs, params, rng, label)
    _check_interleaved(detokenizer, tokenizer, prompt)


def _decoder(tokenizer: Any, skip: bool) -> Callable[[list[int]], str]:
    def decode(ids: list[int]) -> str:
        return str(
            tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        )

    return decode


def _prefix_references(tokenizer: Any, prompt: list[int], ids: list[int], skip: bool) -> list[str]:
    """Reference text of ``ids[:n]`` for every n from 0 to len(ids)."""
    decode = _decoder(tokenizer, skip)
    head = decode(prompt) if prompt else ""
    refs: list[str] = []
    for n in range(len(ids) + 1):
        full = decode(prompt + ids[:n]) if prompt else decode(ids[:n])
        refs.append(full[len(head) :] if prompt and full.startswith(head) else decode(ids[:n]))
    return refs


def _with_specials(tokenizer: Any, ids: list[int], specials: list[int]) -> list[int]:
    """``ids`` with special tokens at both ends and at a character boundary near the middle."""
    decode = _decoder(tokenizer, False)
    middle = next(
        (k for k in range(len(ids) // 2, len(ids)) if not decode(ids[:k]).endswith("\ufffd")),
        len(ids),
    )
    return [specials[0], *ids[:middle], specials[-1], specials[0], *ids[middle:], specials[-1]]


def _chunkings(num_ids: int, rng: random.Random) -> list[list[int]]:
    """Chunk sizes: one id at a time, random 1..3 (twice), random 1..16, all at once."""
    plans = [[1] * num_ids]
    for most in (3, 3, 16):
        sizes: list[int] = []
        left = num_ids
        while left > 0:
            sizes.append(min(rng.randint(1, most), left))
            left -= sizes[-1]
        plans.append(sizes)
    plans.append([num_ids] if num_ids else [])
    return plans


def _run(
    detokenizer: Detokenizer, request: Request, ids: list[int], sizes: list[int]
) -> tuple[list[tuple[int, TextDelta]], TextDelta]:
    """Feed ``ids`` in chunks of ``sizes``; return (ids fed so far, delta) per step and finish."""
    state = detokenizer.start(request)
    empty = detokenizer.step(state, [])
    assert empty == TextDelta(""), f"a step with no ids returned {empty}"
    steps: list[tuple[int, TextDelta]] = []
    fed = 0
    for size in sizes:
        fed += size
        steps.append((fed, detokenizer.step(state, ids[fed - size : fed])))
    return steps, detokenizer.finish(state)


def _stable(text: str) -> str:
    """What may have left: the text without an incomplete character's U+FFFD at the end."""
    return text.rstrip(REPLACEMENT_CHAR)


def _check_generation(
    detokenizer: Detokenizer,
    prompt: list[int],
    ids: list[int],
    refs: list[str],
    skip: bool,
    rng: random.Random,
    label: str,
) -> None:
    expected = refs[-1]
    request = Request("conformance", prompt, SamplingParams(skip_special_tokens=skip))
    for sizes in _chunkings(len(ids), rng):
        where = f"{label}, chunks {sizes[:12]}"
        steps, last = _run(detokenizer, request, ids, sizes)
        deltas = [delta for _, delta in steps] + [last]
        text = "".join(delta.text for delta in deltas)
        assert text == expected, f"{where}: deltas give {text!r}, expected {expected!r}"
        for fed, delta in steps:
            assert delta.stop_reason is None, f"{where}: stop_reason without stop strings"
            if REPLACEMENT_CHAR not in expected:
                assert REPLACEMENT_CHAR not in delta.text, f"{where}: U+FFFD after {fed} ids"
        if set(sizes) == {1}:
            sent = ""
            for fed, delta in steps:
                sent += delta.text
                want = _stable(refs[fed])
                assert sent == want, f"{where}: after {fed} ids {sent!r} left, expected {want!r}"


def _stop_cases(refs: list[str]) -> list[tuple[str, ...]]:
    """Stop-string sets drawn from the reference text ``refs[-1]``."""
    text = refs[-1]
    assert PROMPT_ONLY_STOP not in text, "the prompt-only stop must not be generated"
    assert NEVER_STOP not in text, "the stop that never appears must not be generated"
    middle = len(text) // 2
    # A boundary between two ids' text near the middle, for a stop split across them.
    boundary = next(
        (len(r) for r in refs if len(r) >= middle and not r.endswith(REPLACEMENT_CHAR)), middle
    )
    cases: list[tuple[str, ...]] = [
        (text[middle : middle + 4],),
        (NEVER_STOP, text[-3:], text[middle + 2 : middle + 5]),
        (text[middle : middle + 6], text[middle : middle + 3]),
        (text[max(boundary - 2, 0) : boundary + 2],),
        (NEVER_STOP,),
        (PROMPT_ONLY_STOP,),
        (text[:1],),
    ]
    wide = [i for i, char in enumerate(text) if len(char.encode()) > 1]
    if wide:
        cases.append((text[wide[len(wide) // 2] : wide[len(wide) // 2] + 2],))
    return [tuple(s for s in case if s) or (NEVER_STOP,) for case in cases]


def _expected_stop(refs: list[str], stops: Sequence[str]) -> tuple[int, int, str] | None:
    """(start, end, stop) of the match that ends first (the longest of those), or None."""
    text = refs[-1]
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return None
    end, negative_len, stop = min(found)
    return end + negative_len, end, stop


def _check_stops(
    detokenizer: Detokenizer,
    prompt: list[int],
    ids: list[int],
    refs: list[str],
    params: SamplingParams,
    rng: random.Random,
    label: str,
) -> None:
    match = _expected_stop(refs, params.stop)
    if match is None:
        expected, stop, needed = refs[-1], None, len(ids) + 1
    else:
        start, end, stop = match
        expected = refs[-1][: end if params.include_stop_str_in_output else start]
        needed = next(n for n, ref in enumerate(refs) if ref.startswith(refs[-1][:end]))
    request = Request("conformance", prompt, params)
    for sizes in _chunkings(len(ids), rng):
        where = f"{label}, chunks {sizes[:12]}"
        steps, last = _run(detokenizer, request, ids, sizes)
        text = "".join(delta.text for _, delta in steps) + last.text
        assert text == expected, f"{where}: deltas give {text!r}, expected {expected!r}"
        reported = [(fed, delta) for fed, delta in steps if delta.stop_reason is not None]
        if stop is None:
            assert not reported, f"{where}: a step reported a stop that is not there"
            assert last.stop_reason is None, f"{where}: finish reported a stop not there"
            continue
        assert len(reported) == 1, f"{where}: expected one stop report, got {len(reported)}"
        fed, delta = reported[0]
        first_fed = next(f for f, _ in steps if f >= needed)
        assert fed == first_fed, f"{where}: stop reported after {fed} ids, expected {first_fed}"
        assert delta.stop_reason == stop, f"{where}: stop_reason {delta.stop_reason!r} != {stop!r}"
        assert delta.num_tokens_to_stop == needed, (
            f"{where}: num_tokens_to_stop {delta.num_tokens_to_stop}, expected {needed}"
        )
        after = [d for f, d in steps if f > fed] + [last]
        assert all(not d.text and d.stop_reason is None for d in after), (
            f"{where}: a call after the stop returned text or a stop"
        )
        if set(sizes) == {1}:
            sent = ""
            for fed_now, step_delta in steps[: needed - 1]:
                sent += step_delta.text
                want = _held_back(_stable(refs[fed_now]), params.stop)
                assert sent == want, f"{where}: after {fed_now} ids {sent!r} left, not {want!r}"


def _held_back(text: str, stops: Sequence[str]) -> str:
    """``text`` without its longest suffix that is a proper prefix of a stop string."""
    for start in range(len(text)):
        if any(len(s) > len(text) - start and s.startswith(text[start:]) for s in stops):
            return text[:start]
    return text


def _check_interleaved(detokenizer: Detokenizer, tokenizer: Any, prompt: list[int]) -> None:
    """Two requests stepped alternately on one detokenizer do not disturb each other."""
    texts = DETOKENIZER_TEXTS[2], DETOKENIZER_TEXTS[3]
    all_ids = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    expected = [_prefix_references(tokenizer, prompt, ids, True)[-1] for ids in all_ids]
    states = [detokenizer.start(Request(f"r{i}", prompt, SamplingParams())) for i in range(2)]
    outputs = ["", ""]
    for position in range(max(len(ids) for ids in all_ids)):
        for i, ids in enumerate(all_ids):
            outputs[i] += detokenizer.step(states[i], ids[position : position + 1]).text
    for i in range(2):
        outputs[i] += detokenizer.finish(states[i]).text
        assert outputs[i] == expected[i], f"interleaved request {i}: {outputs[i]!r}"
