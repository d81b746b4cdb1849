"""The offline API: ``LLM(config).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

from brigade.config import EngineConfig, load_config
from brigade.engine import EngineCore, TokenLogprob
from brigade.errors import RequestError
from brigade.interfaces import Detokenizer, ExtraValue, Request, SamplingParams, freeze_extra
from brigade.models.checkpoint import require_tokenizer
from brigade.models.tokenizer_loading import render_chat_prompt
from brigade.registry import Registry, default_registry

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]

PROGRESS_BAR_THRESHOLD = 32
"""Batches of at least this many requests show a progress bar by default."""

Prompt = str | Sequence[int]


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


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


@dataclasses.dataclass(slots=True)
class _Tracked:
    """Frontend state of one engine request: its detokenizer state and collected output."""

    output: CompletionOutput
    state: Any
    finished: bool = False


class LLM:
    """Generate offline with continuous batching, chunked prefill and prefix caching.

    ``config`` is a TOML path, an ``EngineConfig`` or None (defaults: the built-in model).
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | EngineConfig | None = None,
        *,
        overrides: Sequence[str] = (),
        registry: Registry | None = None,
    ) -> None:
        self.registry = registry or default_registry()
        if not isinstance(config, EngineConfig):
            config = load_config(config, self.registry, overrides=overrides)
        self.config = config
        self.engine = EngineCore(config, self.registry)
        self.tokenizer = require_tokenizer(self.engine.checkpoint)
        station = config["detokenizer"]
        self.detokenizer: Detokenizer = self.registry.get(
            "detokenizer", config.plugin("detokenizer")
        ).factory(self.tokenizer, station.options)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int | Sequence[int] = 0,
        extra: Mapping[str, object] | Sequence[Mapping[str, object] | None] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, or a list of token ids); outputs in prompt order.

        ``priority`` is one value for all prompts or one per prompt; lower runs first under
        the ``priority`` scheduler (FCFS ignores it). ``extra`` is data for plugins
        (``Request.extra``: str keys, JSON values, e.g. ``{"deadline_s": 2.0}``), one mapping
        for all prompts or a list of one per prompt. Every prompt is validated before any
        runs: a bad one raises ``RequestError`` and nothing is generated. A request that
        fails on its own while the batch runs gets ``finish_reason`` "error" and its
        ``error``; the others finish as they would have alone. ``EngineDeadError`` means the
        engine can no longer run (the outputs are lost).
        """
        prompt_list = _as_prompt_list(prompts)
        if isinstance(priority, int):
            priorities = [priority] * len(prompt_list)
        elif len(priority) == len(prompt_list):
            priorities = [int(p) for p in priority]
        else:
            raise RequestError(f"{len(priority)} priorities for {len(prompt_list)} prompts")
        extras = _extra_per_prompt(extra, len(prompt_list))
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompt_list):
                raise RequestError(
                    f"{len(sampling_params)} sampling params for {len(prompt_list)} prompts"
                )
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or self.default_sampling_params()] * len(prompt_list)
        encoded = [self._encode(p) for p in prompt_list]
        for index, (token_ids, params) in enumerate(zip(encoded, params_list, strict=True)):
            try:
                self.engine.validate(token_ids, params)
            except RequestError as exc:
                raise RequestError(f"prompt {index}: {exc}") from None
        self._check_grammars(params_list)
        results: list[RequestOutput] = []
        tracked: dict[str, _Tracked] = {}
        for prompt, token_ids, params, level, data in zip(
            prompt_list, encoded, params_list, priorities, extras, strict=True
        ):
            base = str(next(self._ids))
            result = RequestOutput(base, prompt if isinstance(prompt, str) else None, token_ids, [])
            for child in range(params.n):
                child_params = params
                if params.n > 1 and params.seed is not None:
                    child_params = dataclasses.replace(params, seed=params.seed + child)
                request = self.engine.add_request(
                    f"{base}-{child}", token_ids, child_params, priority=level, extra=data
                )
                completion = CompletionOutput(child, "", [], None)
                if params.logprobs is not None:
                    completion.logprobs = []
                result.outputs.append(completion)
                tracked[request.request_id] = _Tracked(completion, self.detokenizer.start(request))
            results.append(result)
        self._run(tracked, use_tqdm)
        return results

    def default_sampling_params(self) -> SamplingParams:
        """What ``generate(prompts)`` uses without parameters: the model's recommended
        sampling (``[model] generation_config = "auto"``) over ``SamplingParams()``."""
        return SamplingParams(**self.engine.sampling_defaults)  # type: ignore[arg-type]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or several,
        through the model's chat template; outputs in conversation order."""
        nested = not messages or not isinstance(messages[0], Mapping)
        groups = cast("Sequence[Sequence[Mapping[str, Any]]]", messages if nested else [messages])
        conversations = [[dict(m) for m in group] for group in groups]
        prompts: list[Prompt] = []
        for index, conversation in enumerate(conversations):
            try:
                prompts.append(
                    render_chat_prompt(
                        self.tokenizer, conversation, add_generation_prompt=add_generation_prompt
                    )
                )
            except Exception as exc:  # a template may reject a conversation (role order, ...)
                raise RequestError(f"conversation {index}: the chat template: {exc}") from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _check_grammars(self, params_list: Sequence[SamplingParams]) -> None:
        """Compile every structured-output grammar (in parallel); raise on the first bad one."""
        gates = []
        for index, params in enumerate(params_list):
            try:
                gates.append((index, self.engine.prepare(params)))
            except RequestError as exc:
                raise RequestError(f"prompt {index}: {exc}") from None
        for index, gate in gates:
            if gate is None:
                continue
            try:
                gate.result()
            except ValueError as exc:
                raise RequestError(f"prompt {index}: {exc}") from None

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def _run(self, tracked: dict[str, _Tracked], use_tqdm: bool | None) -> None:
        from tqdm import tqdm

        show = len(tracked) >= PROGRESS_BAR_THRESHOLD if use_tqdm is None else use_tqdm
        with tqdm(total=len(tracked), disable=not show, desc="generate", unit="req") as bar:
            remaining = len(tracked)
            while remaining:
                for update in self.engine.step():
                    entry = tracked[update.request.request_id]
                    if update.error is not None:
                        if update.invalid:  # only if a grammar failed after _check
                            raise RequestError(update.error)
                        entry.output.finish_reason = "error"
                        entry.output.error = update.error
                        entry.finished = True
                        remaining -= 1
                        bar.update(1)
                        continue
                    if self._apply(entry, update.request, update.new_token_ids, update.logprobs):
                        remaining -= 1
                        bar.update(1)
                        continue
                    if update.finished:
                        self._finish(entry, update.request)
                        remaining -= 1
                        bar.update(1)

    def _apply(
        self,
        entry: _Tracked,
        request: Request,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
    ) -> bool:
        """Add new tokens and their text; True when a stop string ended the request."""
        output = entry.output
        output.token_ids.extend(token_ids)
        if output.logprobs is not None and logprobs is not None:
            output.logprobs.extend(logprobs)
        delta = self.detokenizer.step(entry.state, token_ids)
        output.text += delta.text
        if delta.stop_reason is None:
            return False
        self.engine.abort_request(request.request_id)
        keep = delta.num_tokens_to_stop if delta.num_tokens_to_stop is not None else None
        if keep is not None:
            del output.token_ids[keep:]
            if output.logprobs is not None:
                del output.logprobs[keep:]
        output.finish_reason = "stop"
        output.stop_reason = delta.stop_reason
        entry.finished = True
        return True

    def _finish(self, entry: _Tracked, request: Request) -> None:
        entry.output.text += self.detokenizer.finish(entry.state).text
        entry.output.finish_reason = request.status.value
        entry.finished = True


def _extra_per_prompt(
    extra: Mapping[str, object] | Sequence[Mapping[str, object] | None] | None, num_prompts: int
) -> list[Mapping[str, ExtraValue]]:
    """One frozen ``extra`` per prompt; ``RequestError`` names a bad one."""
    try:
        if extra is None or isinstance(extra, Mapping):
            return [freeze_extra(extra)] * num_prompts
        if not isinstance(extra, Sequence) or isinstance(extra, str | bytes):
            raise ValueError(
                f"extra must be a mapping or a list of one per prompt, got {type(extra).__name__}"
            )
        if len(extra) != num_prompts:
            raise ValueError(f"{len(extra)} extra mappings for {num_prompts} prompts")
        return [freeze_extra(data, name=f"extra[{index}]") for index, data in enumerate(extra)]
    except ValueError as exc:
        raise RequestError(str(exc), param="extra") from None


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]
