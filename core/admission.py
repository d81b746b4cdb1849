"""Admission checks: whether the engine can serve a request, decided once, before it runs.

Whatever passes here is never refused later for its prompt or its sampling parameters; in
particular a parameter that would overflow the step's number formats is refused here, where
one request's value hurts nobody else. ``EngineCore.admit`` runs these checks and starts the
grammar's compile; every front end (``LLM``, the server) admits each prompt once and hands
the resulting :class:`Admission` to the engine with each of its choices.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

from brigade.errors import RequestError
from brigade.interfaces import PoolingParams, SamplingParams

__all__ = ["FLOAT32_MAX", "FLOAT32_TINY", "Admission", "check_request"]

FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: sampling parameters live in float32 rows and act on float32 logits
(the Sampler contract)."""
FLOAT32_TINY = 1.1754943508222875e-38
"""Smallest normal float32 magnitude: below it a value loses its precision or becomes 0."""
FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
MAX_INT64 = 2**63 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """A prompt and its sampling parameters that the engine accepted to serve.

    Made by ``EngineCore.admit`` only; ``EngineCore.add_request`` queues it (and each choice
    of its fan-out, whose parameters differ from ``params`` in ``n`` and ``seed`` alone)
    without checking it again.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: concurrent.futures.Future[Any] | None
    """The compile of ``params.structured_output``, started at admission (None: no grammar).
    It fails with ``ValueError`` saying why when the grammar is invalid; the engine keeps a
    request behind a gate, without pages, until it is done."""
    pooling: PoolingParams | None = None
    """Set for an embedding request: the vector to pool from its hidden states."""


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Raise ``RequestError`` naming the field (``param``) when the request cannot be served."""
    if not prompt_token_ids:
        raise RequestError("the prompt is empty", param="prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
            param="prompt",
        )
    if len(prompt_token_ids) >= max_model_len:
        raise RequestError(
            f"the prompt has {len(prompt_token_ids)} tokens; this engine serves at most "
            f"{max_model_len - 1} prompt tokens (max_model_len {max_model_len})",
            param="prompt",
        )
    for name, ids in (
        ("logit_bias", params.logit_bias or {}),
        ("stop_token_ids", params.stop_token_ids),
    ):
        outside = [t for t in ids if not 0 <= int(t) < vocab_size]
        if outside:
            raise RequestError(
                f"{name} token id {outside[0]} is outside the vocabulary [0, {vocab_size})",
                param=name,
            )
    check_representable(params)


def check_representable(params: SamplingParams) -> None:
    """Refuse sampling parameters that float32 (int64 for ``top_k``) cannot hold."""
    for name in FLOAT_PARAMS:
        value = getattr(params, name)
        if value != 0 and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
            raise RequestError(
                f"{name}={value!r} is invalid: expected 0 or a number of magnitude "
                f"{FLOAT32_TINY:.4g} to {FLOAT32_MAX:.4g} (float32, the sampler's number format)",
                param=name,
            )
    if params.top_k > MAX_INT64:
        raise RequestError(
            f"top_k={params.top_k} is invalid: expected at most {MAX_INT64} (any value from "
            "the vocabulary size up keeps every token)",
            param="top_k",
        )
