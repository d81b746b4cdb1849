"""The offline API: ``LLM(config).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

from brigade.admission import Admission
from brigade.config import OFFLINE_DEFAULTS, EngineConfig, load_config
from brigade.engine import EngineCore
from brigade.errors import RequestError, RequestFailedError
from brigade.interfaces import (
    Detokenizer,
    ExtraValue,
    PoolingParams,
    SamplingParams,
    freeze_extra,
)
from brigade.models.checkpoint import require_tokenizer
from brigade.models.tokenizer_loading import render_chat_prompt
from brigade.output import Choice, CompletionOutput, OutputProcessor, RequestOutput
from brigade.registry import Registry, default_registry

__all__ = ["LLM", "CompletionOutput", "EmbeddingOutput", "RequestOutput"]

PROGRESS_BAR_THRESHOLD = 32
"""Batches of at least this many requests show a progress bar by default."""

Prompt = str | Sequence[int]


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    """One prompt's embedding (``LLM.embed``)."""

    prompt: str | None
    """The prompt's text (None when it was given as token ids)."""
    prompt_token_ids: list[int]
    embedding: list[float] | None
    """The pooled vector (``hidden_size`` floats); None when the request failed."""
    error: str | None = None
    """Why the request failed on its own (a plugin raised for it), else None."""


class LLM:
    """Generate offline with continuous batching, chunked prefill and prefix caching.

    ``config`` is a TOML path, an ``EngineConfig`` or None (defaults: the built-in model).
    Where a path's file, the environment and ``overrides`` leave them unset, a step takes up to
    256 requests and 4096 tokens (:data:`OFFLINE_DEFAULTS`; the server's are 128 and 2048).
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
            config = load_config(
                config, self.registry, overrides=overrides, defaults=OFFLINE_DEFAULTS
            )
        self.config = config
        self.engine = EngineCore(config, self.registry)
        self.tokenizer = require_tokenizer(self.engine.checkpoint)
        station = config["detokenizer"]
        self.detokenizer: Detokenizer = self.registry.get(
            "detokenizer", config.plugin("detokenizer")
        ).factory(self.tokenizer, station.options)
        self.processor = OutputProcessor(self.detokenizer)
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
        fails on its own while the batch runs (or that a plugin fails to queue) gets
        ``finish_reason`` "error" and its ``error``; the others finish as they would have
        alone. ``n`` > 1 fans out as :class:`~brigade.output.OutputProcessor` says (as the
        server does: choice i of a seeded request uses seed + i). ``EngineDeadError`` means the
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
        admissions = self._admit([self._encode(p) for p in prompt_list], params_list)
        results: list[RequestOutput] = []
        run = _Run(self.engine, self.processor)
        for prompt, admission, level, data in zip(
            prompt_list, admissions, priorities, extras, strict=True
        ):
            base = str(next(self._ids))
            choices = self.processor.fan_out(base, admission.params)
            outputs = [
                CompletionOutput(
                    c.index, "", [], None, logprobs=None if c.params.logprobs is None else []
                )
                for c in choices
            ]
            text = prompt if isinstance(prompt, str) else None
            results.append(RequestOutput(base, text, admission.prompt_token_ids, outputs))
            run.add(choices, outputs, admission, level, data)
        run.until_done(use_tqdm)
        return results

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: PoolingParams | None = None,
        *,
        priority: int = 0,
    ) -> list[EmbeddingOutput]:
        """Embed every prompt (text, or a list of token ids) with the served model: its final
        hidden states pooled by ``pooling`` (default: the last token's, L2-normalized, as
        vLLM pools decoder models); outputs in prompt order. The prompts run through the
        engine as batched prefills (chunked, scheduled, on the same KV pool), so embedding
        and generation share one copy of the weights. Every prompt is validated first: a
        bad one raises ``RequestError`` and nothing runs."""
        pooling = pooling or PoolingParams()
        prompt_list = _as_prompt_list(prompts)
        admissions = []
        params = SamplingParams(max_tokens=1)
        for index, token_ids in enumerate(self._encode(p) for p in prompt_list):
            try:
                admissions.append(self.engine.admit(token_ids, params, pooling=pooling))
            except RequestError as exc:
                raise RequestError(f"prompt {index}: {exc}", param=exc.param) from None
        ids = [f"embed-{next(self._ids)}" for _ in prompt_list]
        results: dict[str, EmbeddingOutput] = {}
        for request_id, admission in zip(ids, admissions, strict=True):
            try:
                self.engine.add_request(
                    request_id,
                    admission.prompt_token_ids,
                    params,
                    priority=priority,
                    admission=admission,
                )
            except RequestFailedError as exc:
                results[request_id] = EmbeddingOutput(
                    None, admission.prompt_token_ids, None, str(exc)
                )
        waiting = set(ids) - set(results)
        while waiting:
            for update in self.engine.step():
                if update.finished and update.request.request_id in waiting:
                    waiting.discard(update.request.request_id)
                    request = update.request
                    results[request.request_id] = EmbeddingOutput(
                        None, request.prompt_token_ids, update.embedding, update.error
                    )
        return [
            dataclasses.replace(
                results[request_id], prompt=prompt if isinstance(prompt, str) else None
            )
            for request_id, prompt in zip(ids, prompt_list, strict=True)
        ]

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

    def _admit(
        self, encoded: Sequence[list[int]], params_list: Sequence[SamplingParams]
    ) -> list[Admission]:
        """Admit every prompt, then wait for their grammars (compiling in parallel); raise
        ``RequestError`` naming the first bad prompt."""
        admissions = []
        for index, (token_ids, params) in enumerate(zip(encoded, params_list, strict=True)):
            try:
                admissions.append(self.engine.admit(token_ids, params))
            except RequestError as exc:
                raise RequestError(f"prompt {index}: {exc}", param=exc.param) from None
        for index, admission in enumerate(admissions):
            if admission.grammar is None:
                continue
            try:
                admission.grammar.result()
            except ValueError as exc:
                raise RequestError(f"prompt {index}: {exc}", param="structured_output") from None
        return admissions

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]


class _Run:
    """One ``generate`` call's choices, stepped until every one has finished."""

    def __init__(self, engine: EngineCore, processor: OutputProcessor) -> None:
        self.engine = engine
        self.processor = processor
        self.choices: dict[
            str, tuple[Choice, CompletionOutput, Admission, int, Mapping[str, ExtraValue]]
        ] = {}
        self.num_unfinished = 0

    def add(
        self,
        choices: Sequence[Choice],
        outputs: Sequence[CompletionOutput],
        admission: Admission,
        priority: int,
        extra: Mapping[str, ExtraValue],
    ) -> None:
        """Register a prompt's choices; the first is queued now, the others follow it."""
        for choice, output in zip(choices, outputs, strict=True):
            self.choices[choice.request_id] = (choice, output, admission, priority, extra)
        self.num_unfinished += len(choices)
        self._submit(choices[0])

    def until_done(self, use_tqdm: bool | None) -> None:
        from tqdm import tqdm

        total = len(self.choices)
        show = total >= PROGRESS_BAR_THRESHOLD if use_tqdm is None else use_tqdm
        with tqdm(total=total, disable=not show, desc="generate", unit="req") as bar:
            num_shown = 0
            while self.num_unfinished:
                for update in self.engine.step():
                    choice, output, *_ = self.choices[update.request.request_id]
                    delta = self.processor.process(choice, update)
                    if isinstance(delta.error, RequestError):  # only if its grammar failed late
                        raise delta.error
                    output.append(delta)
                    if choice.followers:
                        for follower in choice.take_followers():
                            self._submit(follower)
                    if delta.stop_reason is not None:  # a stop string: the engine would go on
                        self.engine.abort_request(choice.request_id)
                    if choice.finished:
                        self.num_unfinished -= 1
                bar.update(total - self.num_unfinished - num_shown)
                num_shown = total - self.num_unfinished

    def _submit(self, choice: Choice) -> None:
        """Queue ``choice``; when the engine cannot (a plugin failed), it fails alone."""
        _, output, admission, priority, extra = self.choices[choice.request_id]
        try:
            self.engine.add_request(
                choice.request_id,
                admission.prompt_token_ids,
                choice.params,
                priority=priority,
                admission=admission,
                extra=extra,
            )
        except RequestFailedError as exc:
            output.append(self.processor.fail(choice, exc))
            self.num_unfinished -= 1
            for follower in choice.take_followers():
                self._submit(follower)


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
