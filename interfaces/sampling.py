"""Per-request sampling parameters (the request side of the Sampler contract)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping

__all__ = [
    "POOLING_MODES",
    "PoolingParams",
    "STRUCTURED_OUTPUT_KINDS",
    "SamplingParams",
    "StructuredOutput",
]

STRUCTURED_OUTPUT_KINDS = ("json", "json_schema", "regex", "ebnf", "structural_tag")
"""What a :class:`StructuredOutput` can constrain to (see its ``kind``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the generated text must match, enforced token by token by a grammar stage.

    ``kind`` says how ``spec`` is read:

    - ``json``: any JSON object (``spec`` empty);
    - ``json_schema``: JSON matching the JSON schema in ``spec`` (JSON text);
    - ``regex``: text that fully matches the regular expression ``spec``;
    - ``ebnf``: text derived from the EBNF grammar ``spec`` (root rule ``root``);
    - ``structural_tag``: free text with tagged regions in given formats, ``spec`` being an
      XGrammar structural tag as JSON text (tool calls are built on this).

    Equal values compile to the same grammar, so the pair is the grammar cache's key.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        _require(
            self.kind in STRUCTURED_OUTPUT_KINDS,
            "structured_output.kind",
            self.kind,
            f"one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
        )
        if self.kind == "json":
            _require(not self.spec, "structured_output.spec", self.spec, "empty for kind json")
            return
        _require(
            isinstance(self.spec, str) and bool(self.spec),
            "structured_output.spec",
            self.spec,
            f"a non-empty string for kind {self.kind}",
        )
        if self.kind in ("json_schema", "structural_tag"):
            try:
                value = json.loads(self.spec)
            except ValueError as exc:
                raise ValueError(
                    f"sampling parameter structured_output.spec is invalid: the {self.kind} "
                    f"is not valid JSON ({exc})"
                ) from None
            _require(
                isinstance(value, dict | bool),
                "structured_output.spec",
                self.spec[:80],
                f"a JSON object for kind {self.kind}",
            )


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    Validated on construction: a bad value raises ``ValueError`` naming the field and the
    allowed range, so a request is refused before it reaches the engine.
    """

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling, applied after top_k to the renormalised remaining mass."""
    top_k: int = 0
    """0 disables top-k."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    """Same seed, same output, whatever else is batched."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    """No stop token (nor EOS, unless ``ignore_eos``) is sampled before this many tokens."""
    logprobs: int | None = None
    """Return the top-N log probabilities of each sampled position (0 = sampled token only)."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    structured_output: StructuredOutput | None = None
    """Constrain the output to a grammar (JSON schema, regex, ...); needs a sampler with a
    grammar stage (``xgrammar``)."""

    def __post_init__(self) -> None:
        _require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        _require(
            math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature",
            self.temperature,
            "a number >= 0",
        )
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _require(self.top_k >= 0, "top_k", self.top_k, "an integer >= 0 (0 disables it)")
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2 <= value <= 2, name, value, "a number in [-2, 2]")
        _require(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "a number > 0",
        )
        _require(self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0")
        _require(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, "<= max_tokens")
        _require(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            self.logprobs,
            "an integer in [0, 20]",
        )
        _require(self.n >= 1, "n", self.n, "an integer >= 1")
        _require(
            self.seed is None or -(2**63) <= self.seed < 2**63,
            "seed",
            self.seed,
            "a 64-bit integer (torch's generators take no more)",
        )
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "non-empty strings",
        )
        _require(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "token ids >= 0",
        )
        if self.logit_bias is not None:
            _require(
                all(-100 <= b <= 100 for b in self.logit_bias.values()),
                "logit_bias",
                dict(self.logit_bias),
                "biases in [-100, 100]",
            )

    @property
    def is_greedy(self) -> bool:
        """True when the argmax is taken (temperature 0)."""
        return self.temperature == 0.0


POOLING_MODES = ("last", "mean")
"""How :class:`PoolingParams` turns a prompt's final hidden states into one vector."""


@dataclasses.dataclass(frozen=True, slots=True)
class PoolingParams:
    """Make a request an embedding: its prompt is run, nothing is generated, and the request
    ends with one vector pooled from the model's final hidden states (after the final norm,
    what the LM head reads), as vLLM does for decoder models (API 2.1).

    ``mode`` ``last`` takes the last prompt token's state; ``mean`` averages every prompt
    token's. A ``mean`` request is never matched against the prefix cache (a cached prefix
    has no hidden states to average; see ``Request.uses_prefix_cache``). ``normalize``
    scales the vector to unit L2 norm.
    """

    mode: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(
                f"pooling mode {self.mode!r} is invalid: expected one of {', '.join(POOLING_MODES)}"
            )

    @property
    def needs_every_position(self) -> bool:
        """True when every prompt token's hidden state is pooled (so each must be computed)."""
        return self.mode == "mean"


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"sampling parameter {name}={value!r} is invalid: expected {allowed}")
