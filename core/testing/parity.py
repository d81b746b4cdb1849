"""Tie-aware comparison of greedy token streams (see DESIGN.md, Testing numerics).

Random-weight models have near-tied logits, so two correct implementations may pick
different argmax tokens on float noise. Streams are equal up to their first divergence; there
the reference's scores of the two tokens must be within ``atol``, else the streams differ for
a reason other than noise. After a divergence nothing more can be compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = [
    "GreedyOutput",
    "TokenScores",
    "assert_greedy_match",
    "assert_same_greedy_outputs",
    "reference_greedy",
]


class TokenScores(Protocol):
    """One generated position's log probabilities (``brigade.engine.TokenLogprob`` has these)."""

    @property
    def token_id(self) -> int: ...

    @property
    def logprob(self) -> float: ...

    @property
    def top(self) -> Sequence[tuple[int, float]]:
        """The most likely tokens at this position and their log probabilities."""
        ...


GreedyOutput = tuple[Sequence[int], Sequence[TokenScores | None] | None]
"""One request's greedy tokens and the log probabilities brigade returned for them."""


def reference_greedy(
    model: Any, prompt: Sequence[int], max_tokens: int
) -> tuple[list[int], Callable[[int, int], float]]:
    """A transformers model's greedy continuation of ``prompt`` and a scorer of its logits.

    Exactly ``max_tokens`` tokens (EOS does not stop it); the scorer is what
    :func:`assert_greedy_match` takes as ``reference_score``.
    """
    import torch

    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt)], device=device)
    generated = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits = generated.logits

    def score(step: int, token: int) -> float:
        return float(logits[step][0, token])

    return generated.sequences[0, len(prompt) :].tolist(), score


def assert_greedy_match(
    ours: Sequence[int],
    reference: Sequence[int],
    reference_score: Callable[[int, int], float],
    *,
    atol: float,
    label: str = "",
) -> int:
    """Check two greedy streams; returns how many tokens matched before any divergence.

    ``reference_score(step, token)`` is the reference's logit (or log probability) of
    ``token`` at ``step``. Lengths may differ only if one stream stopped early at a divergence.
    """
    for step, (mine, theirs) in enumerate(zip(ours, reference, strict=False)):
        if mine == theirs:
            continue
        gap = reference_score(step, theirs) - reference_score(step, mine)
        assert gap <= atol, (
            f"{label} step {step}: chose {mine}, reference {theirs}; the reference scores them "
            f"{gap:.3g} apart (> {atol}), so this is not a tie"
        )
        return step
    assert len(ours) == len(reference), (
        f"{label} lengths differ without a divergence: {len(ours)} vs {len(reference)}"
    )
    return len(ours)


def assert_same_greedy_outputs(
    ours: Sequence[GreedyOutput],
    reference: Sequence[GreedyOutput],
    *,
    atol: float,
    label: str = "",
) -> None:
    """Check each of our (tokens, logprobs) against the reference run of the same request.

    Tie-aware like :func:`assert_greedy_match`, scored by the reference's log probabilities, so
    the reference must have been generated with ``SamplingParams(logprobs=k)`` (k >= 2 lets a
    near-tie's runner-up be scored).
    """
    if len(ours) != len(reference):
        raise ValueError(f"{label}: {len(ours)} outputs vs {len(reference)} reference outputs")
    for index, ((tokens, _), (ref_tokens, ref_logprobs)) in enumerate(
        zip(ours, reference, strict=True)
    ):
        if ref_logprobs is None:
            raise ValueError(f"{label} #{index}: the reference has no logprobs to score ties with")

        def score(
            step: int, token: int, logprobs: Sequence[TokenScores | None] = ref_logprobs
        ) -> float:
            entry = logprobs[step]
            if entry is None:
                return float("-inf")
            table = dict(entry.top)
            table.setdefault(entry.token_id, entry.logprob)
            return table.get(token, float("-inf"))

        assert_greedy_match(tokens, ref_tokens, score, atol=atol, label=f"{label} #{index}")
