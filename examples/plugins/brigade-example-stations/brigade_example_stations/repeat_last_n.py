"""The ``repeat-last-n`` logits processor: llama.cpp's windowed repetition penalty.

Every token among a request's last ``n`` tokens (prompt and output alike, as llama.cpp's
``repeat_last_n`` counts its context) has its logit divided by ``penalty`` when positive and
multiplied by it otherwise, once however often it occurs. Small models fall into loops that
this breaks, without punishing a word used once long ago as an unwindowed penalty does.

Select it with ``[sampler] logits_processors = ["repeat-last-n"]``; ``last_n`` and
``penalty`` in ``[sampler.logits_processor_options.repeat-last-n]`` apply to every request, and
a request overrides them through its ``extra``: ``{"repeat_last_n": 32, "repeat_penalty":
1.3}`` (over HTTP in the body's ``extra_args``); ``repeat_last_n = 0`` or ``repeat_penalty =
1`` turns it off for that request.

State per persistent row, in tensors: a ring of the row's latest tokens (token ``i`` of the
sequence at slot ``i % width``), how many tokens it has seen, its window and its penalty. A
step's :meth:`apply` is a handful of whole-batch operations; :meth:`accept_batch` writes one
slot per row. The ring is :data:`MAX_ROLLBACK` slots wider than the largest window, so that a
speculative step's rejected drafts roll back exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from brigade.interfaces import LogitsProcessor, Request, SamplerParams, option

from brigade_example_stations.request_stages import token_tensor

__all__ = ["MAX_LAST_N", "RepeatLastNOptions", "RepeatLastNProcessor"]

MAX_LAST_N = 512
"""The largest window a config or a request may ask for."""
MAX_ROLLBACK = 64
"""Tokens core rolls back at most at once (``LogitsProcessor.rollback``)."""


@dataclasses.dataclass(frozen=True)
class RepeatLastNOptions:
    """Options of the ``repeat-last-n`` logits processor (a request's ``extra`` overrides)."""

    last_n: int = option(
        64,
        help="how many of a request's latest tokens (prompt and output) are penalised; "
        "0 = off unless a request sets extra.repeat_last_n",
        ge=0,
        le=MAX_LAST_N,
    )
    penalty: float = option(
        1.1,
        help="divides a repeated token's positive logit, multiplies a negative one "
        "(1 = off unless a request sets extra.repeat_penalty)",
        gt=0,
    )


class RepeatLastNProcessor(LogitsProcessor):
    """Penalises the tokens of each request's last ``n`` tokens (see the module docstring).

    ``add`` raises ``ValueError`` for a request whose ``extra`` holds a bad
    ``repeat_last_n`` or ``repeat_penalty``, which fails that request alone.
    """

    def __init__(self, params: SamplerParams, options: RepeatLastNOptions) -> None:
        self.options = options
        self._vocab_size = params.vocab_size
        self._device = params.device
        self._width = MAX_LAST_N + MAX_ROLLBACK
        rows = params.max_num_seqs
        self._history = torch.zeros(rows, self._width, dtype=torch.int64, device=params.device)
        """[rows, width] the latest tokens of each row, token i at slot i % width."""
        self._count = torch.zeros(rows, dtype=torch.int64, device=params.device)
        """[rows] tokens each row has seen (prompt and output)."""
        self._window = torch.zeros(rows, dtype=torch.int64, device=params.device)
        """[rows] the row's ``n``; 0 for rows this stage leaves alone."""
        self._penalty = torch.ones(rows, dtype=torch.float32, device=params.device)
        self._slots = torch.arange(self._width, device=params.device)  # [width]
        self._tracked: set[int] = set()

    def settings(self, request: Request) -> tuple[int, float]:
        """(window, penalty) for ``request``: its ``extra`` over the options."""
        last_n = request.extra.get("repeat_last_n", self.options.last_n)
        if not isinstance(last_n, int) or isinstance(last_n, bool):
            last_n = -1
        if not 0 <= last_n <= MAX_LAST_N:
            raise ValueError(
                f"request {request.request_id}: extra.repeat_last_n must be an integer from "
                f"0 to {MAX_LAST_N}, got {request.extra.get('repeat_last_n')!r}"
            )
        penalty = request.extra.get("repeat_penalty", self.options.penalty)
        if not isinstance(penalty, int | float) or isinstance(penalty, bool):
            penalty = math.nan
        if not (penalty > 0 and math.isfinite(penalty)):
            raise ValueError(
                f"request {request.request_id}: extra.repeat_penalty must be a number above "
                f"0, got {request.extra.get('repeat_penalty')!r}"
            )
        return last_n, float(penalty)

    def add(self, row: int, request: Request) -> None:
        """Track ``request`` in ``row``, its ring filled from its prompt and output tokens."""
        self.remove(row)
        window, penalty = self.settings(request)
        if window == 0 or penalty == 1.0:
            return
        sequence = [*request.prompt_token_ids, *request.output_token_ids]
        latest = sequence[-self._width :]
        what = f"the tokens of request {request.request_id}"
        tokens = token_tensor(latest, self._vocab_size, what, self._device)
        first = len(sequence) - len(latest)
        slots = torch.arange(first, len(sequence), device=self._device) % self._width
        self._history[row, slots] = tokens
        self._count[row] = len(sequence)
        self._window[row] = window
        self._penalty[row] = penalty
        self._tracked.add(row)

    def remove(self, row: int) -> None:
        """Leave ``row`` alone from now on."""
        if row in self._tracked:
            self._tracked.discard(row)
            self._window[row] = 0
            self._penalty[row] = 1.0

    @property
    def is_active(self) -> bool:
        """True while some row is penalised."""
        return bool(self._tracked)

    def is_position_independent(self, request: Request) -> bool:
        """True for a request this stage leaves alone (window 0 or penalty 1)."""
        try:
            window, penalty = self.settings(request)
        except ValueError:
            return False
        return window == 0 or penalty == 1.0

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits: [S, vocab] for persistent rows ``rows`` [S] -> penalised logits."""
        count = self._count[rows].unsqueeze(1)  # [S, 1]
        # age: [S, width], how many tokens ago each slot was written (0 = the latest).
        age = (count - 1 - self._slots).remainder(self._width)
        limit = torch.minimum(self._window[rows].unsqueeze(1), count)  # [S, 1]
        tokens = self._history[rows]  # [S, width]
        in_window = (age < limit) & (tokens >= 0) & (tokens < self._vocab_size)
        # Slots outside the window mark a spare column, so that every write sets True.
        columns = torch.where(in_window, tokens, self._vocab_size)  # [S, width]
        seen = torch.zeros(
            logits.shape[0], self._vocab_size + 1, dtype=torch.bool, device=logits.device
        ).scatter_(1, columns, True)[:, : self._vocab_size]  # [S, vocab]
        penalty = self._penalty[rows].unsqueeze(1)  # [S, 1]
        repeated = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(seen, repeated, logits)

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Write one token per row into its ring (rows left alone too: harmless, reset by
        ``add``)."""
        if not self._tracked:
            return
        row_index = torch.tensor(rows, dtype=torch.int64, device=self._device)
        tokens = torch.tensor(token_ids, dtype=torch.int64, device=self._device)
        slots = self._count[row_index] % self._width
        self._history[row_index, slots] = tokens
        self._count[row_index] += 1

    def accept(self, row: int, token_ids: Sequence[int]) -> None:
        """Write ``token_ids`` into ``row``'s ring, in order."""
        for token in token_ids:
            self.accept_batch([row], [token])

    def rollback(self, row: int, num_tokens: int) -> None:
        """Forget the row's last ``num_tokens`` tokens (at most :data:`MAX_ROLLBACK`): the
        ring still holds the window before them."""
        if num_tokens > MAX_ROLLBACK:
            raise ValueError(f"cannot roll back {num_tokens} tokens; at most {MAX_ROLLBACK}")
        if row in self._tracked:
            self._count[row] -= num_tokens
