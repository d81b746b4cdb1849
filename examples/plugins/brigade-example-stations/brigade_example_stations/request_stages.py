"""The request's own stages of the ``plain-torch`` sampler's chain: bias and penalties, then
``min_tokens``.

A sampler owns a request's ``logit_bias``, penalties and ``min_tokens`` (``Sampler``'s
contract), so a third-party sampler brings stages for them. These keep their per-row state in
dense tensors ``[max_num_seqs, vocab]``, allocated when the first request that needs them
arrives: :meth:`apply` is then a few whole-batch operations, and rows that use nothing hold
neutral values that leave a logit unchanged (``x + 0``, ``x / 1``, ``x * 1``, ``x - 0``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from brigade.interfaces import LogitsProcessor, Request, SamplerParams

__all__ = ["BiasAndPenalties", "MinTokensMask", "token_tensor"]


def token_tensor(
    token_ids: Sequence[int], vocab_size: int, what: str, device: str | torch.device
) -> torch.Tensor:
    """``token_ids`` as int64, refusing ids the logits have no column for (``ValueError``)."""
    bad = sorted({t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)})
    if bad:
        raise ValueError(
            f"{what} holds token ids outside the vocabulary: {bad[:8]}; allowed are integers "
            f"0 to {vocab_size - 1}"
        )
    return torch.tensor(list(token_ids), dtype=torch.int64, device=device)


class BiasAndPenalties(LogitsProcessor):
    """A request's ``logit_bias``, then its repetition, presence and frequency penalties.

    Repetition penalty ``r`` acts on tokens of the prompt or the output (a positive logit is
    divided by ``r``, any other multiplied); presence and frequency on output tokens only
    (``logit -= presence * (count > 0) + frequency * count``).
    """

    def __init__(self, params: SamplerParams) -> None:
        self._params = params
        self._tables: dict[str, torch.Tensor] = {}
        """Lazily allocated: ``bias`` [rows, vocab] float32, ``prompt_seen`` [rows, vocab]
        bool, ``counts`` [rows, vocab] int32 (output tokens), and ``repetition``,
        ``presence``, ``frequency`` [rows] float32."""
        self._biased: set[int] = set()
        self._penalised: set[int] = set()

    def _table(self, name: str) -> torch.Tensor:
        table = self._tables.get(name)
        if table is None:
            rows, vocab = self._params.max_num_seqs, self._params.vocab_size
            shapes = {
                "bias": ((rows, vocab), torch.float32, 0.0),
                "prompt_seen": ((rows, vocab), torch.bool, False),
                "counts": ((rows, vocab), torch.int32, 0),
                "repetition": ((rows,), torch.float32, 1.0),
                "presence": ((rows,), torch.float32, 0.0),
                "frequency": ((rows,), torch.float32, 0.0),
            }
            shape, dtype, neutral = shapes[name]
            table = torch.full(shape, neutral, dtype=dtype, device=self._params.device)
            self._tables[name] = table
        return table

    def add(self, row: int, request: Request) -> None:
        """Load the request's bias and penalties (and, after a preemption, its output counts);
        ``ValueError`` for a token id outside the vocabulary."""
        self.remove(row)
        sampling = request.sampling_params
        vocab, device = self._params.vocab_size, self._params.device
        if sampling.logit_bias:
            what = f"logit_bias of request {request.request_id}"
            tokens = token_tensor(list(sampling.logit_bias), vocab, what, device)
            values = [float(v) for v in sampling.logit_bias.values()]
            self._table("bias")[row, tokens] = torch.tensor(values, device=device)
            self._biased.add(row)
        repetition = sampling.repetition_penalty
        presence, frequency = sampling.presence_penalty, sampling.frequency_penalty
        if repetition == 1.0 and presence == 0.0 and frequency == 0.0:
            return
        prompt = token_tensor(request.prompt_token_ids, vocab, "prompt_token_ids", device)
        output = token_tensor(request.output_token_ids, vocab, "output_token_ids", device)
        self._table("prompt_seen")[row, prompt] = True
        self._table("counts")[row].index_put_(
            (output,), torch.ones_like(output, dtype=torch.int32), accumulate=True
        )
        self._table("repetition")[row] = repetition
        self._table("presence")[row] = presence
        self._table("frequency")[row] = frequency
        self._penalised.add(row)

    def remove(self, row: int) -> None:
        """Reset ``row`` to neutral values."""
        if row in self._biased:
            self._biased.discard(row)
            self._tables["bias"][row] = 0.0
        if row in self._penalised:
            self._penalised.discard(row)
            for name in ("prompt_seen", "counts", "presence", "frequency"):
                self._tables[name][row] = 0
            self._tables["repetition"][row] = 1.0

    @property
    def is_active(self) -> bool:
        """True while some row has a bias or a penalty."""
        return bool(self._biased or self._penalised)

    def is_position_independent(self, request: Request) -> bool:
        """A bias alone is the same at every position; penalties count tokens."""
        sampling = request.sampling_params
        return (
            sampling.repetition_penalty == 1.0
            and sampling.presence_penalty == 0.0
            and sampling.frequency_penalty == 0.0
        )

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits: [S, vocab] for persistent rows ``rows`` [S] -> edited logits."""
        if self._biased:
            logits = logits + self._tables["bias"][rows]
        if self._penalised:
            counts = self._tables["counts"][rows]  # [S, vocab]
            in_output = counts > 0  # [S, vocab]
            seen = self._tables["prompt_seen"][rows] | in_output  # [S, vocab]
            penalty = self._tables["repetition"][rows].unsqueeze(1)  # [S, 1]
            repeated = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, repeated, logits)
            presence = self._tables["presence"][rows].unsqueeze(1)  # [S, 1]
            frequency = self._tables["frequency"][rows].unsqueeze(1)  # [S, 1]
            logits = logits - (frequency * counts + presence * in_output)
        return logits

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Count one output token per row (every row: neutral rows ignore their counts)."""
        if not self._penalised:
            return
        row_index = torch.tensor(rows, dtype=torch.int64, device=self._params.device)
        token_index = torch.tensor(token_ids, dtype=torch.int64, device=self._params.device)
        counts = self._table("counts")
        ones = torch.ones_like(row_index, dtype=torch.int32)
        counts.index_put_((row_index, token_index), ones, accumulate=True)


class MinTokensMask(LogitsProcessor):
    """Masks a request's stop ids (and EOS, unless ``ignore_eos``) until it has
    ``min_tokens`` output tokens: the chain's last stage, so nothing re-enables them."""

    def __init__(self, params: SamplerParams) -> None:
        self._params = params
        self._stops: torch.Tensor | None = None
        """[max_num_seqs, vocab] bool, True where a tracked row's token is masked."""
        self._remaining: dict[int, int] = {}
        """Tracked row -> output tokens it must still produce."""

    def add(self, row: int, request: Request) -> None:
        """Track ``request`` while it is short of ``min_tokens``."""
        self.remove(row)
        sampling = request.sampling_params
        remaining = sampling.min_tokens - request.num_output_tokens
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops |= request.eos_token_ids
        # Ids without a logits column can never be sampled anyway.
        stops = {t for t in stops if 0 <= t < self._params.vocab_size}
        if remaining <= 0 or not stops:
            return
        if self._stops is None:
            shape = (self._params.max_num_seqs, self._params.vocab_size)
            self._stops = torch.zeros(shape, dtype=torch.bool, device=self._params.device)
        self._stops[row, sorted(stops)] = True
        self._remaining[row] = remaining

    def remove(self, row: int) -> None:
        """Forget ``row``."""
        if self._remaining.pop(row, None) is not None and self._stops is not None:
            self._stops[row] = False

    @property
    def is_active(self) -> bool:
        """True while some row is short of its ``min_tokens``."""
        return bool(self._remaining)

    def is_position_independent(self, request: Request) -> bool:
        """True once nothing is masked for ``request`` any more."""
        return request.num_output_tokens >= request.sampling_params.min_tokens

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Set the tracked rows' stop ids to -inf."""
        if self._stops is None:  # never: the add that made this stage active allocated it
            return logits
        return logits.masked_fill(self._stops[rows], float("-inf"))

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Count one token for each tracked row of the step (a loop over tracked rows only)."""
        if not self._remaining:
            return
        for row in self._remaining.keys() & set(rows):
            self._remaining[row] -= 1
            if self._remaining[row] <= 0:
                self.remove(row)
