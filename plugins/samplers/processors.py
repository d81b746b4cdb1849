"""The standard sampler's logits processors: min_tokens, logit_bias and penalties.

Each keeps its per-row state in tensors on the sampler's device, so :meth:`apply` is a few
vectorised calls for the whole batch whatever its composition. Python work happens only when
a request joins or leaves a row (``add``/``remove``) and, for the token-tracking stages, in
building one index list per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch

from brigade.interfaces import LogitsProcessor, Request, SamplerParams

__all__ = ["MAX_ROLLBACK", "LogitBiasProcessor", "MinTokensProcessor", "PenaltiesProcessor"]

MAX_ROLLBACK = 128
"""Tokens a token-tracking processor can roll back (more than any step's drafts)."""


def _token_tensor(
    token_ids: Sequence[int], vocab_size: int, what: str, device: str
) -> torch.Tensor:
    """``token_ids`` as an int64 tensor, refusing ids the logits have no column for."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{what} holds token ids outside the vocabulary: {sorted(set(bad))[:8]}; "
            f"allowed are 0 to {vocab_size - 1}"
        )
    return torch.tensor(token_ids, dtype=torch.int64, device=device)


class _RowTokenTable:
    """Sparse per-row ``{token_id: value}`` entries added to logits in one ``index_put_``.

    Entries live on the host and are flattened to three device tensors only after a change,
    so a step in which no request joined or left costs no host work.
    """

    def __init__(self, params: SamplerParams) -> None:
        self._max_num_seqs = params.max_num_seqs
        self._device = params.device
        self._entries: dict[int, dict[int, float]] = {}
        self._flat: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __bool__(self) -> bool:
        return bool(self._entries)

    def put(self, row: int, entries: Mapping[int, float]) -> None:
        """Replace ``row``'s entries (an empty mapping drops the row)."""
        self._entries.pop(row, None)
        if entries:
            self._entries[row] = dict(entries)
        self._flat = None

    def drop(self, row: int) -> None:
        """Forget ``row``'s entries."""
        if self._entries.pop(row, None) is not None:
            self._flat = None

    def add_to(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Add each entry of the sampled rows to ``logits`` [S, vocab] in place."""
        entry_rows, entry_tokens, entry_values = self._flatten()
        # position: [max_num_seqs] index of each persistent row in this step's logits, or -1
        position = torch.full((self._max_num_seqs,), -1, dtype=torch.int64, device=logits.device)
        position[rows] = torch.arange(rows.numel(), dtype=torch.int64, device=logits.device)
        sample_index = position[entry_rows]  # [E]
        # Entries of rows not sampled this step add 0 to row 0 instead of being filtered out,
        # which would need a device-to-host sync; accumulate keeps their zeros harmless.
        found = sample_index >= 0
        values = torch.where(found, entry_values, torch.zeros_like(entry_values))
        logits.index_put_((sample_index.clamp_min(0), entry_tokens), values, accumulate=True)
        return logits

    def _flatten(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._flat is None:
            rows = [row for row, entries in self._entries.items() for _ in entries]
            tokens = [token for entries in self._entries.values() for token in entries]
            values = [value for entries in self._entries.values() for value in entries.values()]
            self._flat = (
                torch.tensor(rows, dtype=torch.int64, device=self._device),
                torch.tensor(tokens, dtype=torch.int64, device=self._device),
                torch.tensor(values, dtype=torch.float32, device=self._device),
            )
        return self._flat


class LogitBiasProcessor(LogitsProcessor):
    """Adds each request's ``logit_bias`` ({token_id: bias}) to its row's logits."""

    needs_tokens: ClassVar[bool] = False

    def __init__(self, params: SamplerParams) -> None:
        self._vocab_size = params.vocab_size
        self._table = _RowTokenTable(params)

    def add(self, row: int, request: Request) -> None:
        """Track ``request``'s bias; raises ``ValueError`` for a token id outside the vocab."""
        bias = request.sampling_params.logit_bias or {}
        bad = [t for t in bias if not (isinstance(t, int) and 0 <= t < self._vocab_size)]
        if bad:
            raise ValueError(
                f"logit_bias of request {request.request_id} names token ids outside the "
                f"vocabulary: {bad[:8]}; allowed are integers 0 to {self._vocab_size - 1}"
            )
        self._table.put(row, {token: float(value) for token, value in bias.items()})

    def remove(self, row: int) -> None:
        """Forget ``row``'s bias."""
        self._table.drop(row)

    @property
    def is_active(self) -> bool:
        """True while some row has a non-empty ``logit_bias``."""
        return bool(self._table)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Add the biases in place (one ``index_put_``)."""
        return self._table.add_to(logits, rows)


class MinTokensProcessor(LogitsProcessor):
    """Masks a row's EOS and stop token ids until it has produced ``min_tokens`` tokens.

    EOS ids are left alone for ``ignore_eos`` requests: EOS does not end them, so it is an
    ordinary token there (vLLM does the same). Ids without a logits column are skipped: they
    can never be sampled anyway.
    """

    def __init__(self, params: SamplerParams) -> None:
        self._vocab_size = params.vocab_size
        self._remaining: dict[int, int] = {}
        """Row -> tokens it must still produce before its stop ids are allowed."""
        self._table = _RowTokenTable(params)
        self._tracked: dict[int, tuple[int, dict[int, float]]] = {}
        """Row -> (tokens counted minus min_tokens, its masked ids) from add to remove, so a
        rollback can mask again what a count had released (speculative decoding)."""

    def add(self, row: int, request: Request) -> None:
        """Track ``request`` if it has fewer than ``min_tokens`` output tokens so far."""
        self.remove(row)
        params = request.sampling_params
        remaining = params.min_tokens - request.num_output_tokens
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= request.eos_token_ids
        banned = {token for token in banned if 0 <= token < self._vocab_size}
        if remaining <= 0 or not banned:
            return
        masked = dict.fromkeys(banned, float("-inf"))
        self._tracked[row] = (remaining, masked)
        self._remaining[row] = remaining
        self._table.put(row, masked)

    def remove(self, row: int) -> None:
        """Forget ``row``."""
        self._remaining.pop(row, None)
        self._tracked.pop(row, None)
        self._table.drop(row)

    def rollback(self, row: int, num_tokens: int) -> None:
        """Uncount the row's last ``num_tokens`` tokens (masking its stop ids again if they
        bring it back under ``min_tokens``)."""
        tracked = self._tracked.get(row)
        if tracked is None:
            return
        remaining = tracked[0] + num_tokens
        self._tracked[row] = (remaining, tracked[1])
        if remaining > 0:
            self._remaining[row] = remaining
            self._table.put(row, tracked[1])

    @property
    def is_active(self) -> bool:
        """True while some row is still short of its ``min_tokens``."""
        return bool(self._remaining)

    def is_position_independent(self, request: Request) -> bool:
        """True once ``request`` has its ``min_tokens``: nothing is masked any more."""
        return request.num_output_tokens >= request.sampling_params.min_tokens

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Set the masked ids of the tracked rows to -inf in place."""
        return self._table.add_to(logits, rows)

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Count one token for each tracked row in ``rows`` (a loop over tracked rows only)."""
        if not self._remaining:
            return
        accepted = set(rows)
        for row in [r for r in self._remaining if r in accepted]:
            self._count(row, 1)

    def accept(self, row: int, token_ids: Sequence[int]) -> None:
        """Count ``len(token_ids)`` tokens for ``row``."""
        if row in self._remaining:
            self._count(row, len(token_ids))

    def _count(self, row: int, num_tokens: int) -> None:
        remaining = self._remaining[row] - num_tokens
        self._tracked[row] = (remaining, self._tracked[row][1])
        self._remaining[row] = remaining
        if remaining <= 0:
            self._remaining.pop(row)
            self._table.drop(row)


class PenaltiesProcessor(LogitsProcessor):
    """Repetition (vLLM/HF), presence and frequency (OpenAI) penalties.

    Repetition penalty ``r`` applies to tokens seen in the prompt or the output: a positive
    logit is divided by ``r``, any other multiplied by it. Presence and frequency apply over
    output tokens only: ``logit -= presence * (count > 0) + frequency * count``.

    State per persistent row: output-token counts ``[max_num_seqs, vocab]`` int32 (one
    accumulate per step), a prompt-token mask ``[max_num_seqs, vocab]`` bool (filled in
    :meth:`add`) and the three penalty values. Rows without penalties hold neutral values, and
    :meth:`apply` works on every sampled row with them rather than selecting penalised rows:
    selecting would need a device-to-host sync and a dynamic shape, and the neutral values
    leave a logit bit-for-bit unchanged (``x / 1``, ``x * 1``, ``x - 0``).
    """

    def __init__(self, params: SamplerParams) -> None:
        rows, vocab, device = params.max_num_seqs, params.vocab_size, params.device
        self._vocab_size = vocab
        self._device = device
        self._output_counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
        self._prompt_mask = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self._repetition = torch.ones(rows, dtype=torch.float32, device=device)
        self._presence = torch.zeros(rows, dtype=torch.float32, device=device)
        self._frequency = torch.zeros(rows, dtype=torch.float32, device=device)
        self._one = torch.ones((), dtype=torch.int32, device=device)
        self._repetition_rows: set[int] = set()
        self._additive_rows: set[int] = set()
        """Rows with a presence or frequency penalty."""
        self._recent: dict[int, list[int]] = {}
        """Penalised row -> its latest accepted tokens (at most :data:`MAX_ROLLBACK`), which a
        rollback uncounts (speculative decoding)."""

    def add(self, row: int, request: Request) -> None:
        """Load ``request``'s penalties, prompt mask and (after preemption) output counts."""
        self.remove(row)
        params = request.sampling_params
        repetition = params.repetition_penalty
        presence, frequency = params.presence_penalty, params.frequency_penalty
        if repetition == 1.0 and presence == 0.0 and frequency == 0.0:
            return
        # Rows without penalties are counted too (accept_batch does not filter), so reset.
        counts = self._output_counts[row]  # [vocab]
        counts.zero_()
        if request.output_token_ids:
            output = _token_tensor(
                request.output_token_ids, self._vocab_size, "output_token_ids", self._device
            )
            counts.index_put_((output,), self._one, accumulate=True)
        if repetition != 1.0:
            prompt = _token_tensor(
                request.prompt_token_ids, self._vocab_size, "prompt_token_ids", self._device
            )
            self._prompt_mask[row].zero_()
            self._prompt_mask[row, prompt] = True
            self._repetition[row] = repetition
            self._repetition_rows.add(row)
        if presence != 0.0 or frequency != 0.0:
            self._presence[row] = presence
            self._frequency[row] = frequency
            self._additive_rows.add(row)
        self._recent[row] = []

    def remove(self, row: int) -> None:
        """Reset ``row`` to neutral penalties (its counts are reset by the next ``add``)."""
        self._recent.pop(row, None)
        if row in self._repetition_rows:
            self._repetition_rows.discard(row)
            self._repetition[row] = 1.0
        if row in self._additive_rows:
            self._additive_rows.discard(row)
            self._presence[row] = 0.0
            self._frequency[row] = 0.0

    def is_position_independent(self, request: Request) -> bool:
        """True for a request without penalties (its row is left alone)."""
        params = request.sampling_params
        return (
            params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0
        )

    @property
    def is_active(self) -> bool:
        """True while some row has a non-neutral penalty."""
        return bool(self._repetition_rows or self._additive_rows)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Penalise ``logits`` [S, vocab]; each kind is skipped when no row uses it."""
        counts = self._output_counts[rows]  # [S, vocab] int32
        in_output = counts > 0  # [S, vocab]
        if self._repetition_rows:
            penalty = self._repetition[rows].unsqueeze(1)  # [S, 1]
            seen = self._prompt_mask[rows] | in_output  # [S, vocab]
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalised, logits)
        if self._additive_rows:
            presence = self._presence[rows].unsqueeze(1)  # [S, 1]
            frequency = self._frequency[rows].unsqueeze(1)  # [S, 1]
            logits = logits - (frequency * counts + presence * in_output)
        return logits

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Count one token per row with a single accumulate (no per-row Python work)."""
        if not self.is_active:
            return
        row_index = torch.tensor(rows, dtype=torch.int64, device=self._device)
        token_index = torch.tensor(token_ids, dtype=torch.int64, device=self._device)
        self._output_counts.index_put_((row_index, token_index), self._one, accumulate=True)
        recent = self._recent
        for row, token in zip(rows, token_ids, strict=True):  # penalised rows only
            history = recent.get(row)
            if history is not None:
                history.append(token)
                if len(history) > MAX_ROLLBACK:
                    del history[: -(MAX_ROLLBACK // 2)]

    def rollback(self, row: int, num_tokens: int) -> None:
        """Uncount the row's last ``num_tokens`` tokens; a row without penalties has nothing
        to undo (its counts are reset when a request with penalties takes it)."""
        history = self._recent.get(row)
        if history is None or num_tokens <= 0:
            return
        if num_tokens > len(history):
            raise ValueError(
                f"row {row}: cannot roll back {num_tokens} tokens, only {len(history)} are kept"
            )
        tokens = torch.tensor(history[-num_tokens:], dtype=torch.int64, device=self._device)
        del history[-num_tokens:]
        rows = torch.full_like(tokens, row)
        self._output_counts.index_put_((rows, tokens), -self._one, accumulate=True)

    def accept(self, row: int, token_ids: Sequence[int]) -> None:
        """Count ``token_ids`` for ``row``."""
        if self.is_active and token_ids:
            self.accept_batch([row] * len(token_ids), token_ids)
