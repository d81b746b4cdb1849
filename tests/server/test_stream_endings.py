"""A stream the server ends before it is done says so: an error event (OpenAI's shape) before
``[DONE]``, or ``response.failed`` for the Responses API, never a silent end. The ends: the
shutdown timeout (finish reason "abort"), the engine's death, a forced stop (``fail_all``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

import pytest

from brigade.admission import Admission
from brigade.engine import StepUpdate
from brigade.errors import EngineDeadError
from brigade.interfaces import ExtraValue, SamplingParams
from brigade.output import ChoiceDelta
from brigade.server import protocol as proto
from brigade.server.errors import ServerOverloadedError
from brigade.server.generation import ChatRun
from brigade.server.request_streams import RequestStreams
from brigade.server.responses_api import ResponsesRequest, _events
from brigade.server.streaming import chat_events, completion_events


async def deltas(
    items: Sequence[ChoiceDelta], then: BaseException | None = None
) -> AsyncGenerator[ChoiceDelta, None]:
    for item in items:
        yield item
    if then is not None:
        raise then


async def drain(events: AsyncGenerator[bytes, None]) -> list[str]:
    return [event.decode() async for event in events]


def sse(deltas_: AsyncGenerator[ChoiceDelta, None], *, chat: bool) -> list[str]:
    kind = chat_events if chat else completion_events
    events = kind(
        deltas_,
        response_id="id",
        model="tiny",
        created=0,
        tokenizer=None,
        prompt_tokens=2,
        want_logprobs=False,
        include_usage=False,
    )
    return asyncio.run(drain(events))


def data(event: str) -> dict[str, Any]:
    assert event.startswith("data: {"), event
    return json.loads(event.removeprefix("data: "))


@pytest.mark.parametrize("chat", [True, False])
def test_a_stream_the_shutdown_timeout_aborted_ends_with_an_error_event(chat: bool) -> None:
    aborted = [ChoiceDelta(0, "Hi", [5], None), ChoiceDelta(0, "", [], None, "abort")]
    events = sse(deltas(aborted), chat=chat)
    assert events[-1] == "data: [DONE]\n\n"
    assert data(events[-3])["choices"][0]["finish_reason"] == "abort"
    error = data(events[-2])["error"]
    assert (error["type"], error["code"]) == ("server_error", "server_overloaded")
    assert "shutting down" in error["message"]


@pytest.mark.parametrize("chat", [True, False])
def test_a_stream_that_finished_has_no_error_event(chat: bool) -> None:
    finished = [ChoiceDelta(0, "Hi", [5], None), ChoiceDelta(0, "!", [6], None, "length")]
    events = sse(deltas(finished), chat=chat)
    assert events[-1] == "data: [DONE]\n\n"
    assert all("error" not in data(event) for event in events[:-1])


def responses_events(stream: AsyncGenerator[ChoiceDelta, None]) -> list[dict[str, Any]]:
    body = proto.decode_json(
        b'{"model": "tiny", "input": "Hello", "stream": true}', ResponsesRequest
    )
    run = ChatRun([1, 2], SamplingParams(max_tokens=4), stream, False, "id")
    events = asyncio.run(drain(_events(body, run, "resp_1", 0.0, "tiny")))
    return [json.loads(event.split("data: ", 1)[1]) for event in events]


def test_a_responses_stream_whose_engine_died_ends_with_response_failed() -> None:
    died = deltas([ChoiceDelta(0, "Hi", [5], None)], then=EngineDeadError("the engine died"))
    events = responses_events(died)
    assert events[-1]["type"] == "response.failed"
    assert "engine died" in events[-1]["response"]["error"]["message"]


def test_a_responses_stream_the_server_aborted_ends_with_response_failed() -> None:
    events = responses_events(deltas([ChoiceDelta(0, "Hi", [5], None, "abort")]))
    assert events[-1]["type"] == "response.failed"
    assert "shutting down" in events[-1]["response"]["error"]["message"]


class SilentEngine(RequestStreams):
    """Takes requests and never answers; records aborts."""

    def __init__(self) -> None:
        super().__init__(max_waiting_requests=10)
        self.aborted: list[str] = []

    def _submit(
        self,
        request_id: str,
        admission: Admission,
        params: SamplingParams,
        priority: int,
        extra: Mapping[str, ExtraValue],
        sink: asyncio.Queue[StepUpdate | BaseException],
    ) -> None:
        pass

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_fail_all_ends_every_open_stream_with_the_error_and_aborts_it() -> None:
    engine = SilentEngine()
    params = SamplingParams(max_tokens=4)
    error = ServerOverloadedError("stopped at once")

    async def run() -> list[BaseException]:
        async def consume(request_id: str) -> BaseException:
            with pytest.raises(ServerOverloadedError) as caught:
                async for _ in engine.generate(request_id, Admission([1, 2], params, None), params):
                    pass
            return caught.value

        tasks = [asyncio.create_task(consume(f"r{i}")) for i in range(3)]
        while engine.num_in_flight < 3:
            await asyncio.sleep(0)
        engine.fail_all(error)
        return list(await asyncio.gather(*tasks))

    assert asyncio.run(run()) == [error] * 3
    assert sorted(engine.aborted) == ["r0", "r1", "r2"]
    assert engine.num_in_flight == 0
