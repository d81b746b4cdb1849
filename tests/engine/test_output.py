"""One output processor and one admission for ``LLM`` and the server.

The same request through ``LLM.generate`` and through the HTTP app (in process, on its own
engine over the same model) gives the same text, tokens and finish reasons; each prompt is
checked once and its grammar compile started once, whichever front end it comes from.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from litestar.testing import TestClient
from server_harness import tiny_model

from brigade import LLM, SamplingParams
from brigade.config import load_config
from brigade.errors import RequestError
from brigade.interfaces import StructuredOutput
from brigade.registry import default_registry
from brigade.server.app import create_app
from brigade.server.serve import build_state

PROMPT = [5, 6, 7, 8, 9]
LONG_PROMPT = list(range(100, 164))
"""8 full pages of 8 tokens."""
LOGPROB_ATOL = 1e-5
"""Two engines, same weights, same batches, fp32 on the CPU: equal up to float noise."""
REGEX = "[a-z]{3,6}"


def settings(model_dir: Path) -> list[str]:
    return [
        f"model.path={model_dir}",
        "model.dtype=float32",
        "model.max_model_len=256",
        "kv.page_size=8",
        "kv.num_pages=256",
        'server.served_model_name="tiny"',
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("output"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(overrides=settings(model_dir))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[tuple[TestClient[Any], Any]]:
    """The HTTP app on its own engine (started in process, so tests can count calls)."""
    # An earlier in-process `brigade serve` (tests/config/test_cli.py) leaves structlog writing to
    # that test's captured stderr, closed since: log to the current stdout again.
    structlog.reset_defaults()
    registry = default_registry()
    state = build_state(load_config(None, registry, overrides=settings(model_dir)), registry)
    try:
        with TestClient(create_app(state)) as client:
            yield client, state
    finally:
        state.async_engine.shutdown()


def complete(server: tuple[TestClient[Any], Any], **body: Any) -> dict[str, Any]:
    response = server[0].post("/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    result["choices"].sort(key=lambda choice: choice["index"])
    return result


def stop_across_a_token_boundary(llm: LLM) -> tuple[str, int, str]:
    """A stop string made of the end of one generated token and the start of the next, the
    number of tokens up to the one that completes it, and the full greedy text."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    [result] = llm.generate(PROMPT, params)
    ids, text = result.outputs[0].token_ids, result.outputs[0].text
    for k in range(len(ids) - 1):
        head, piece = llm.tokenizer.decode(ids[: k + 1]), llm.tokenizer.decode(ids[k + 1 : k + 2])
        stop = head[-1:] + piece[:1]
        if (
            len(stop) == 2
            and not stop.isspace()
            and "\ufffd" not in stop
            and text.startswith(head)
            and text.find(stop) == len(head) - 1
        ):
            return stop, k + 2, text
    raise AssertionError(f"no two-token stop string in {text!r}")


# -- the same answers ---------------------------------------------------------------------------


def record_children(monkeypatch: pytest.MonkeyPatch, engine: Any) -> list[tuple[int, Any]]:
    """(n, seed) of every engine request added from now on."""
    added: list[tuple[int, Any]] = []
    original = engine.add_request

    def add_request(request_id: str, prompt: Any, params: SamplingParams, **kw: Any) -> Any:
        added.append((params.n, params.seed))
        return original(request_id, prompt, params, **kw)

    monkeypatch.setattr(engine, "add_request", add_request)
    return added


def test_seeded_n_choices_match_between_llm_and_server(
    llm: LLM, server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    offline_children = record_children(monkeypatch, llm.engine)
    online_children = record_children(monkeypatch, server[1].async_engine.engine)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    [offline] = llm.generate(PROMPT, params)
    online = complete(
        server, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True
    )
    assert offline_children == online_children == [(1, 7), (1, 8), (1, 9)]
    assert [c.index for c in offline.outputs] == [0, 1, 2]
    assert [c["index"] for c in online["choices"]] == [0, 1, 2]
    texts = [c.text for c in offline.outputs]
    assert [c["text"] for c in online["choices"]] == texts
    assert len(set(texts)) > 1, "choice i uses seed + i"
    assert [c.finish_reason for c in offline.outputs] == ["length"] * 3
    assert [c["finish_reason"] for c in online["choices"]] == ["length"] * 3
    assert online["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in offline.outputs)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_cuts_the_same_text_and_tokens(
    llm: LLM, server: Any, include: bool
) -> None:
    stop, num_tokens, text = stop_across_a_token_boundary(llm)
    expected = text[: text.index(stop) + (len(stop) if include else 0)]
    params = SamplingParams(
        max_tokens=24,
        temperature=0.0,
        ignore_eos=True,
        stop=(stop,),
        include_stop_str_in_output=include,
        logprobs=1,
    )
    [offline] = llm.generate(PROMPT, params)
    body = {
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0.0,
        "ignore_eos": True,
        "stop": [stop],
        "include_stop_str_in_output": include,
        "logprobs": 1,
    }
    online = complete(server, **body)
    [choice] = online["choices"]
    output = offline.outputs[0]
    assert output.text == choice["text"] == expected
    assert output.finish_reason == choice["finish_reason"] == "stop"
    assert output.stop_reason == stop
    assert len(output.token_ids) == online["usage"]["completion_tokens"] == num_tokens
    assert output.logprobs is not None
    assert len(output.logprobs) == num_tokens
    ours = [entry.logprob for entry in output.logprobs if entry is not None]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(ours, abs=LOGPROB_ATOL)
    streamed = _streamed_text(server, body)
    assert streamed == expected, "the held-back text leaves the stream as it leaves LLM"


def _streamed_text(server: Any, body: dict[str, Any]) -> str:
    with server[0].stream(
        "POST", "/v1/completions", json={"model": "tiny", "stream": True, **body}
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines)


def test_logprobs_of_n_choices_match(llm: LLM, server: Any) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=2, logprobs=2)
    [offline] = llm.generate(PROMPT, params)
    online = complete(server, prompt=PROMPT, max_tokens=6, temperature=0.8, seed=3, n=2, logprobs=2)
    for output, choice in zip(offline.outputs, online["choices"], strict=True):
        assert output.text == choice["text"]
        assert output.finish_reason == choice["finish_reason"]
        assert output.logprobs is not None
        ours = [entry.logprob for entry in output.logprobs if entry is not None]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(ours, abs=LOGPROB_ATOL)
        assert [len(top) for top in choice["logprobs"]["top_logprobs"]] == [
            len({*(token for token, _ in entry.top), entry.token_id})
            for entry in output.logprobs
            if entry is not None
        ]


def test_greedy_n_choices_are_copies_of_one_answer(llm: LLM, server: Any) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, n=3, ignore_eos=True)
    [offline] = llm.generate(PROMPT, params)
    online = complete(server, prompt=PROMPT, max_tokens=6, temperature=0.0, n=3, ignore_eos=True)
    texts = [c.text for c in offline.outputs]
    assert len(set(texts)) == 1
    assert [c["text"] for c in online["choices"]] == texts


def test_offline_n_choices_share_the_prompt_pages(llm: LLM) -> None:
    before = llm.engine.stats().prefix_cache_hits
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=11, n=4)
    [result] = llm.generate(LONG_PROMPT, params)
    assert len(result.outputs) == 4
    hits = llm.engine.stats().prefix_cache_hits - before
    assert hits >= 3 * 56, f"choices 1-3 should reuse choice 0's prompt pages, hits {hits}"


def test_a_failing_finish_log_line_ends_the_response(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def closed_stream(*args: Any, **kwargs: Any) -> None:
        raise ValueError("I/O operation on closed file.")

    monkeypatch.setattr("brigade.server.frontend.log_request_finished", closed_stream)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            server[0].post,
            "/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "n": 2},
        )
        response = answer.result(timeout=120)  # before: it waited for the choice forever
    assert response.status_code == 500
    assert "I/O operation" not in response.text, "no internals in the answer"


# -- one admission ------------------------------------------------------------------------------


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Count calls of ``owner.name`` (it still runs)."""
    calls: list[int] = []
    original: Callable[..., Any] = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def admission_counters(monkeypatch: pytest.MonkeyPatch, engine: Any) -> tuple[list, list]:
    import brigade.engine

    checks = count_calls(monkeypatch, brigade.engine, "check_request")
    compiles = count_calls(monkeypatch, engine.grammar, "prepare")
    return checks, compiles


def test_llm_checks_a_structured_request_once_and_compiles_its_grammar_once(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks, compiles = admission_counters(monkeypatch, llm.engine)
    params = SamplingParams(
        max_tokens=8,
        temperature=1.0,
        seed=1,
        n=3,
        structured_output=StructuredOutput("regex", REGEX),
    )
    [result] = llm.generate(PROMPT, params)
    assert len(result.outputs) == 3
    assert (len(checks), len(compiles)) == (1, 1), "one admission for the prompt and its 3 choices"


def test_the_server_checks_a_structured_request_once_and_compiles_its_grammar_once(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks, compiles = admission_counters(monkeypatch, server[1].async_engine.engine)
    response = server[0].post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "a word"}],
            "max_tokens": 8,
            "n": 3,
            "seed": 1,
            "response_format": {"type": "regex", "regex": REGEX},
        },
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 3
    assert (len(checks), len(compiles)) == (1, 1), "one admission for the prompt and its 3 choices"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "regex", "regex": "(unclosed"}}, "response_format"),
        ({"logit_bias": {"999999": 1.0}}, "logit_bias"),
        ({"prompt": [999999]}, "prompt"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field_and_the_server_goes_on(
    server: Any, body: dict[str, Any], param: str
) -> None:
    response = server[0].post(
        "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **body}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert complete(server, prompt=PROMPT, max_tokens=2)["choices"][0]["finish_reason"]
    assert not server[1].async_engine.engine.has_unfinished()


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (
            SamplingParams(structured_output=StructuredOutput("regex", "(unclosed")),
            "structured_output",
        ),
        (SamplingParams(logit_bias={999999: 1.0}), "logit_bias"),
    ],
)
def test_a_bad_request_is_a_request_error_naming_the_field_and_llm_goes_on(
    llm: LLM, params: SamplingParams, param: str
) -> None:
    with pytest.raises(RequestError, match="prompt 1") as refused:
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2), params])
    assert refused.value.param == param
    assert not llm.engine.has_unfinished(), "nothing of the batch was queued"
    [ok] = llm.generate(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    assert ok.outputs[0].finish_reason == "length"
