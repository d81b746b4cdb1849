"""The output processor: engine step updates in, each choice's text out.

``LLM.generate`` and the server's ``Frontend`` turn engine requests into text through this
one module: the ``n`` choices of a prompt (fan-out), the detokenizer state of each,
stop strings (the text held back while one may still be forming, the tokens and logprobs
trimmed to the stop), finish reasons and failures. It is synchronous and pure Python; the
caller drives it with the engine's :class:`~brigade.engine.StepUpdate` of each choice (``LLM``
from its step loop, the server from its event loop) and gets one :class:`ChoiceDelta` per
update: the server streams the deltas, ``LLM`` adds them up with
:meth:`CompletionOutput.append`. Per update it does what a front end must do anyway: one
detokenizer step, and a slice when a stop string ends the choice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from brigade.engine import StepUpdate, TokenLogprob
from brigade.errors import RequestError, RequestFailedError
from brigade.interfaces import Detokenizer, SamplingParams

__all__ = ["Choice", "ChoiceDelta", "CompletionOutput", "OutputProcessor", "RequestOutput"]


@dataclasses.dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """New output of one choice; ``finish_reason`` is set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    """The ids behind ``text`` (after a stop string, only those up to it)."""
    logprobs: list[TokenLogprob] | None
    """One per id of ``token_ids`` when the request asked for logprobs."""
    finish_reason: str | None = None
    """'stop' (EOS, stop token or stop string), 'length', 'abort', or 'error'."""
    stop_reason: str | None = None
    """The stop string that ended the choice: the engine would go on, so the caller aborts
    the choice's engine request."""
    error: RequestError | RequestFailedError | None = None
    """Why the choice failed (``finish_reason`` "error"): ``RequestError`` when the request
    itself is at fault, ``RequestFailedError`` when it failed on its own while it ran."""


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (``n`` of them per prompt)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """'stop' (EOS, stop token or stop string), 'length', 'abort', or 'error' (it failed on
    its own: see ``error``)."""
    stop_reason: str | None = None
    """The stop string that ended it, when one did."""
    logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    """Why it failed (a plugin raised for it, or its sampling was undefined); the other
    requests of the batch were not affected."""

    def append(self, delta: ChoiceDelta) -> None:
        """Add one delta of this choice (logprobs are kept when ``logprobs`` is a list)."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if self.logprobs is not None and delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.error = None if delta.error is None else str(delta.error)


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """What ``LLM.generate`` returns for one prompt: its choices in index order."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


@dataclasses.dataclass(slots=True, eq=False)
class Choice:
    """One choice of a prompt: the engine request that produces it and its output state.

    Owned by the :class:`OutputProcessor` that made it; callers read it and submit
    ``request_id`` with ``params``.
    """

    request_id: str
    index: int
    """Position of the choice in its response (``index_offset`` plus its place among ``n``)."""
    params: SamplingParams
    """The engine request's parameters: the prompt's, with ``n`` 1 and, when seeded, its own
    seed."""
    followers: list[Choice]
    """Choices to submit once this one has its first update or has failed (the rest of an
    ``n`` > 1 fan-out, so that their prompt pages come from the prefix cache); see
    :meth:`take_followers`."""
    num_tokens: int = 0
    """Tokens output so far, up to the stop (what usage counts)."""
    finished: bool = False
    detokenizer_state: Any = None
    """The detokenizer's state, started on the choice's first update."""

    def take_followers(self) -> list[Choice]:
        """The followers, once: the caller submits them now (later calls return [])."""
        followers, self.followers = self.followers, []
        return followers


class OutputProcessor:
    """Fans a prompt out into its choices and turns their step updates into deltas.

    ``n`` follows vLLM's parallel sampling: the prompt becomes ``n`` engine requests
    ``f"{request_id}-{i}"``, each with ``n`` 1; with a ``seed``, choice i uses ``seed + i``
    (distinct and reproducible), without one the choices sample independently. Greedy
    sampling with ``n`` > 1 is allowed and gives ``n`` copies of one answer. There is no
    ``best_of`` (as in vLLM v1, the server refuses one other than ``n``). Choice 0 runs
    first and the others join after its first update (Brigade's fork: their prompt pages are
    then cached, not recomputed); outputs are grouped by ``index`` whatever order they
    finish in.
    """

    def __init__(self, detokenizer: Detokenizer) -> None:
        self.detokenizer = detokenizer

    def fan_out(
        self, request_id: str, params: SamplingParams, *, index_offset: int = 0
    ) -> list[Choice]:
        """The ``params.n`` choices of one prompt, indexed from ``index_offset``; the first
        holds the others as its ``followers``."""
        children = [
            Choice(f"{request_id}-{child}", index_offset + child, _child_params(params, child), [])
            for child in range(params.n)
        ]
        children[0].followers.extend(children[1:])
        return children

    def process(self, choice: Choice, update: StepUpdate) -> ChoiceDelta:
        """The delta of one step update of ``choice``'s engine request.

        A stop string ends the choice (``finish_reason`` "stop", ``stop_reason`` set): its
        text ends at the stop (or after it, with ``include_stop_str_in_output``) and its
        tokens and logprobs at the token that completed the stop; the caller aborts the
        engine request. A failed update flushes the held-back text and carries ``error``.
        """
        state = choice.detokenizer_state
        if state is None:
            state = choice.detokenizer_state = self.detokenizer.start(update.request)
        if update.error is not None:
            choice.finished = True
            text = self.detokenizer.finish(state).text
            error = (RequestError if update.invalid else RequestFailedError)(update.error)
            return ChoiceDelta(choice.index, text, [], None, "error", error=error)
        tokens, logprobs = update.new_token_ids, update.logprobs
        text_delta = self.detokenizer.step(state, tokens)
        if text_delta.stop_reason is not None:
            choice.finished = True
            keep = text_delta.num_tokens_to_stop
            if keep is not None:
                cut = max(0, keep - choice.num_tokens)
                tokens = tokens[:cut]
                logprobs = None if logprobs is None else logprobs[:cut]
            choice.num_tokens += len(tokens)
            return ChoiceDelta(
                choice.index, text_delta.text, tokens, logprobs, "stop", text_delta.stop_reason
            )
        choice.num_tokens += len(tokens)
        if not update.finished:
            return ChoiceDelta(choice.index, text_delta.text, tokens, logprobs)
        choice.finished = True
        text = text_delta.text + self.detokenizer.finish(state).text
        return ChoiceDelta(choice.index, text, tokens, logprobs, update.request.status.value)

    def fail(self, choice: Choice, error: RequestError | RequestFailedError) -> ChoiceDelta:
        """The last delta of a choice whose request failed before its first update."""
        choice.finished = True
        return ChoiceDelta(choice.index, "", [], None, "error", error=error)


def _child_params(params: SamplingParams, child: int) -> SamplingParams:
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + child
    return dataclasses.replace(params, n=1, seed=seed)
