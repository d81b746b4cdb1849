"""Per-request ``extra`` data: frozen JSON on ``Request.extra``, filled from HTTP
``extra_args`` (or vLLM's ``vllm_xargs``), ``LLM.generate`` and ``EngineCore.add_request``,
and read by schedulers and logits processors."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from protocol_helpers import chat_body, completion_body, protocol_error
from server_harness import tiny_model, tiny_server_config
from simulated_helpers import LLAMA_3_70B, settings

from brigade import LLM, SamplingParams
from brigade.config import load_config
from brigade.engine import EngineCore
from brigade.errors import RequestError
from brigade.interfaces import (
    EMPTY_EXTRA,
    LogitsProcessor,
    Request,
    SamplerParams,
    SchedulerView,
    freeze_extra,
)
from brigade.plugins.samplers.standard import StandardSampler, StandardSamplerOptions
from brigade.plugins.schedulers.fcfs import FcfsOptions, FcfsPolicy
from brigade.registry import Registry, load_registry
from brigade.server.protocol import ChatCompletionRequest, CompletionRequest, decode_json

# -- the data type ----------------------------------------------------------------------------


def test_extra_is_a_frozen_deep_copy() -> None:
    source: dict[str, Any] = {"tenant": "acme", "tags": ["a", {"b": 1}], "deadline_s": 2.5}
    extra = freeze_extra(source)
    source["tenant"] = "changed"
    source["tags"].append("c")
    assert dict(extra) == {"tenant": "acme", "tags": ("a", {"b": 1}), "deadline_s": 2.5}
    with pytest.raises(TypeError):
        extra["tenant"] = "x"  # type: ignore[index]
    with pytest.raises(TypeError):
        extra["tags"][1]["b"] = 2  # type: ignore[index]
    assert freeze_extra(None) is EMPTY_EXTRA
    assert freeze_extra({}) is EMPTY_EXTRA
    request = Request("r", [1], SamplingParams(), extra={"x": [1, 2]})
    assert request.extra == {"x": (1, 2)}
    assert Request("q", [1], SamplingParams()).extra == {}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tags": {1, 2}}, r"extra\['tags'\] is a set; allowed: str, int"),
        ({"deadline_s": math.nan}, r"extra\['deadline_s'\] is nan: JSON has no NaN"),
        ({"x": [0, math.inf]}, r"extra\['x'\]\[1\] is inf"),
        ({3: "three"}, "has the key 3; keys must be str"),
        (["deadline_s", 2], "extra must be a mapping"),
        ({"deep": [[[[[]]]]] * 1}, None),  # five levels are fine
    ],
)
def test_extra_that_is_not_json_data_is_refused_by_name(extra: Any, message: str | None) -> None:
    if message is None:
        freeze_extra(extra)
        return
    with pytest.raises(ValueError, match=message):
        freeze_extra(extra)


def test_extra_nested_past_the_limit_is_refused() -> None:
    value: list[Any] = []
    for _ in range(70):
        value = [value]
    with pytest.raises(ValueError, match="nests more than 64 levels"):
        freeze_extra({"deep": value})


# -- the engine and LLM -----------------------------------------------------------------------


class RecordingPolicy(FcfsPolicy):
    """FCFS that keeps the ``extra`` of every request it is given."""

    seen: dict[str, Any]

    def __init__(self, view: SchedulerView, options: FcfsOptions) -> None:
        super().__init__(view, options)
        self.seen = {}

    def enqueue(self, request: Request, *, preempted: bool) -> None:
        self.seen[request.request_id] = request.extra
        super().enqueue(request, preempted=preempted)


class BanFromExtra(LogitsProcessor):
    """Bans the token id ``request.extra["ban_token"]`` for that request's row."""

    needs_tokens = False

    def __init__(self) -> None:
        self.banned: dict[int, int] = {}

    def add(self, row: int, request: Request) -> None:
        token = request.extra.get("ban_token")
        if isinstance(token, int):
            self.banned[row] = token

    def remove(self, row: int) -> None:
        self.banned.pop(row, None)

    @property
    def is_active(self) -> bool:
        return bool(self.banned)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        for index, row in enumerate(rows.tolist()):
            if row in self.banned:
                logits[index, self.banned[row]] = -math.inf
        return logits


class BanningSampler(StandardSampler):
    """The standard sampler with :class:`BanFromExtra` after its own stages."""

    def __init__(self, params: SamplerParams, options: StandardSamplerOptions) -> None:
        super().__init__(params, options)
        self._processors = (*self._processors, BanFromExtra())


def extra_registry() -> Registry:
    registry = load_registry()
    registry.add("scheduler", "recording", RecordingPolicy, options=FcfsOptions)
    registry.add("sampler", "banning", BanningSampler, options=StandardSamplerOptions)
    return registry


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("extra"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    overrides = [
        f"model.path={model_dir}",
        'scheduler.plugin="recording"',
        'sampler.plugin="banning"',
        "kv.page_size=8",
        "kv.num_pages=64",
    ]
    return LLM(overrides=overrides, registry=extra_registry())


def seen(llm: LLM) -> dict[str, Any]:
    scheduler = llm.engine.scheduler.policy
    assert isinstance(scheduler, RecordingPolicy)
    return scheduler.seen


GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def test_llm_generate_hands_one_extra_to_every_prompt_or_one_each(llm: LLM) -> None:
    prompts = [[11, 12, 13], [21, 22, 23]]
    llm.generate(prompts, GREEDY, extra={"tenant": "acme"})
    recorded = seen(llm)
    assert [dict(recorded[key]) for key in list(recorded)[-2:]] == [{"tenant": "acme"}] * 2
    llm.generate(prompts, SamplingParams(max_tokens=2, n=2), extra=[{"deadline_s": 1}, None])
    # Two choices per prompt; followers join after choice 0's first token, so order by id.
    last = sorted(
        list(recorded.items())[-4:], key=lambda item: [int(p) for p in item[0].split("-")]
    )
    assert [dict(extra) for _, extra in last] == [{"deadline_s": 1}] * 2 + [{}] * 2


def test_llm_generate_refuses_a_bad_extra_before_running_anything(llm: LLM) -> None:
    before = len(seen(llm))
    with pytest.raises(ValueError, match="3 extra mappings for 2 prompts"):
        llm.generate([[1, 2], [3, 4]], GREEDY, extra=[{}, {}, {}])
    with pytest.raises(RequestError, match=r"extra\[1\]\['at'\] is a set"):
        llm.generate([[1, 2], [3, 4]], GREEDY, extra=[{}, {"at": {1}}])
    with pytest.raises(RequestError, match="extra must be a mapping or a list"):
        llm.generate([[1, 2]], GREEDY, extra=42)  # type: ignore[arg-type]
    assert len(seen(llm)) == before
    assert not llm.engine.has_unfinished()


def test_a_logits_processor_reads_extra(llm: LLM) -> None:
    prompt = [31, 32, 33, 34]
    (plain,) = llm.generate([prompt], GREEDY)
    first = plain.outputs[0].token_ids[0]
    (banned,) = llm.generate([prompt], GREEDY, extra={"ban_token": first})
    assert banned.outputs[0].token_ids[0] != first
    (again,) = llm.generate([prompt], GREEDY)  # the row forgot the ban with its request
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids


def test_add_request_takes_extra_and_names_a_bad_one(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_70B), encoding="utf-8")
    registry = load_registry()
    config = load_config(
        None, registry, overrides=["executor.plugin=simulated", *settings(tmp_path)]
    )
    engine = EngineCore(config, registry)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    request = engine.add_request("r", [11, 12], params, extra={"priority_class": "gold"})
    assert request.extra == {"priority_class": "gold"}
    with pytest.raises(RequestError, match=r"extra\['x'\] is a bytes") as info:
        engine.add_request("s", [11, 12], params, extra={"x": b"raw"})
    assert info.value.param == "extra"
    assert "s" not in engine.requests


# -- HTTP -------------------------------------------------------------------------------------


def test_extra_args_and_vllm_xargs_decode_to_frozen_extra() -> None:
    body = completion_body(extra_args={"deadline_s": 2.0, "tags": ["x"]})
    assert decode_json(body, CompletionRequest).extra() == {"deadline_s": 2.0, "tags": ("x",)}
    chat = decode_json(chat_body(vllm_xargs={"tenant": "acme"}), ChatCompletionRequest)
    assert chat.extra() == {"tenant": "acme"}
    assert decode_json(chat_body(), ChatCompletionRequest).extra() is EMPTY_EXTRA


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"extra_args": ["deadline_s", 2]}, "extra_args", "expected `object | null`, got `array`"),
        ({"extra_args": "deadline_s=2"}, "extra_args", "expected `object | null`, got `str`"),
        ({"vllm_xargs": 3}, "vllm_xargs", "got `int`"),
        ({"extra_args": {}, "vllm_xargs": {}}, "vllm_xargs", "give one of extra_args or"),
    ],
)
def test_extra_args_that_are_not_an_object_are_a_400_naming_the_field(
    fields: dict[str, Any], param: str, message: str
) -> None:
    for body, type_ in (
        (completion_body(**fields), CompletionRequest),
        (chat_body(**fields), ChatCompletionRequest),
    ):
        error = protocol_error(body, type_)
        assert error.param == param
        assert message in str(error)


def test_extra_args_nested_too_deep_is_a_400() -> None:
    deep: Any = 1
    for _ in range(70):
        deep = {"a": deep}
    error = protocol_error(completion_body(extra_args=deep), CompletionRequest)
    assert error.param == "extra_args"


@pytest.fixture(scope="module")
def app(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """The server app in-process, over an engine whose scheduler records ``extra``."""
    import structlog
    from litestar.testing import TestClient

    from brigade.server.app import create_app
    from brigade.server.logs import configure_logging
    from brigade.server.serve import build_state

    path = tmp_path_factory.mktemp("extra-server") / "server.toml"
    path.write_text(tiny_server_config(model_dir, max_model_len=128, num_pages=64))
    registry = extra_registry()
    config = load_config(str(path), registry, overrides=['scheduler.plugin="recording"'])
    state = build_state(config, registry)
    # An earlier test may have configured logging onto a captured stream that is closed now.
    saved = structlog.get_config()
    configure_logging(stream=io.StringIO())
    try:
        with TestClient(create_app(state)) as client:
            yield client, state.async_engine.engine.scheduler.policy
    finally:
        state.async_engine.shutdown()
        structlog.configure(**saved)


def post(client: Any, path: str, **body: Any) -> Any:
    return client.post(path, json={"model": "tiny", "max_tokens": 2, **body})


def test_extra_args_reach_the_scheduler_over_http(app: tuple[Any, Any]) -> None:
    client, scheduler = app
    response = post(client, "/v1/completions", prompt=[5, 6, 7], extra_args={"deadline_s": 3})
    assert response.status_code in (200, 201), response.text
    assert dict(list(scheduler.seen.values())[-1]) == {"deadline_s": 3}
    response = post(
        client,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        vllm_xargs={"tenant": "acme"},
        n=2,
    )
    assert response.status_code in (200, 201), response.text
    assert [dict(extra) for extra in list(scheduler.seen.values())[-2:]] == [{"tenant": "acme"}] * 2
    response = post(client, "/v1/completions", prompt=[[5, 6], [7, 8]], extra_args={"k": [1]})
    assert response.status_code in (200, 201), response.text
    assert [dict(extra) for extra in list(scheduler.seen.values())[-2:]] == [{"k": (1,)}] * 2


def test_bad_extra_args_over_http_is_a_400_naming_the_field(app: tuple[Any, Any]) -> None:
    client, scheduler = app
    before = len(scheduler.seen)
    response = post(client, "/v1/completions", prompt="hi", extra_args=[1, 2])
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "extra_args"
    assert len(scheduler.seen) == before
