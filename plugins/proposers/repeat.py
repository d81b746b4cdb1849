"""Drafts the request's last token, ``max_tokens`` times: for simulation studies.

Under the simulated executor (``[executor] plugin = "simulated"``) the token ids are random,
so prompt lookup and suffix decoding never find a match; there, what a proposer drafts does
not matter, only how many drafts it offers, and the executor's ``draft_acceptance`` decides
how many are accepted. This proposer always offers the most a request may verify, which makes
speculation's cost and gain visible to ``brigade bench`` at cluster scale. On a real model it
is a weak guess (it pays only on runs of one repeated token).
"""

from __future__ import annotations

from collections.abc import Sequence

from brigade.interfaces import DraftSlot, Proposer

__all__ = ["RepeatLastProposer"]


class RepeatLastProposer(Proposer):
    """``max_tokens`` copies of the request's last token (see the module docstring)."""

    def propose(self, slots: Sequence[DraftSlot]) -> list[list[int]]:
        drafts = []
        for slot in slots:
            request = slot.request
            tokens = request.output_token_ids or request.prompt_token_ids
            drafts.append([tokens[-1]] * slot.max_tokens)
        return drafts
