"""Tie-aware comparison of greedy token streams (see DESIGN.md, Testing numerics).

Random-weight models have near-tied logits, so two correct implementations may pick
different argmax tokens on float noise. Streams are equal up to their first divergence; there
the reference's scores of the two tokens must be within ``atol``, else the streams differ for
a reason other than noise. After a divergence nothing more can be compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["assert_greedy_match"]


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
