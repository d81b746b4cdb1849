"""The ``ban-words`` logits processor: words and token ids the engine never generates.

Select it with ``[sampler] logits_processors = ["ban-words"]`` and list what to ban in
``[sampler.logits_processor_options.ban-words]``. It applies to every request.

A word is banned as a token sequence, as vLLM's ``bad_words`` and transformers'
``NoBadWordsLogitsProcessor`` do: each word is tokenized as written and with a leading space
(how it reads mid-sentence), and the last token of such a sequence is masked whenever a row's
output ends with the tokens before it; a one-token sequence is masked at every step. Only
output tokens count: a sequence that would start in the prompt is not matched.

Cost: single tokens are one ``masked_fill_`` over the batch. Multi-token words add, per step,
a host-side look-up of each sampled row's last tokens (O(rows), in :meth:`begin_step`, which
overlaps the forward pass on a GPU) and one ``index_put_``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from brigade.interfaces import LogitsProcessor, Request, SamplerParams, option
from brigade.plugins.samplers.processors import MAX_ROLLBACK, _token_tensor

__all__ = ["BanWordsOptions", "BanWordsProcessor"]


@dataclasses.dataclass(frozen=True)
class BanWordsOptions:
    """Options of the ``ban-words`` logits processor."""

    words: tuple[str, ...] = option(
        (),
        help="strings never generated, tokenized with the model's tokenizer as written and "
        "with a leading space; a word of several tokens is stopped by masking its last token "
        "once the output ends with the others",
    )
    token_ids: tuple[int, ...] = option((), help="token ids never generated")

    def __post_init__(self) -> None:
        if any(not word.strip() for word in self.words):
            raise ValueError(f"words must not hold empty or blank strings, got {self.words!r}")
        negative = [token for token in self.token_ids if token < 0]
        if negative:
            raise ValueError(f"token_ids must be >= 0, got {negative}")


class BanWordsProcessor(LogitsProcessor):
    """Masks banned tokens, and the last token of banned sequences, in every added row.

    Raises ``ValueError`` at construction for a token id outside the vocabulary, or for
    ``words`` when the engine has no tokenizer (``params.checkpoint`` is None or has none).
    """

    def __init__(self, params: SamplerParams, options: BanWordsOptions) -> None:
        self._device = params.device
        sequences = {(token,) for token in options.token_ids} | _tokenize(params, options.words)
        flat = [token for sequence in sorted(sequences) for token in sequence]
        _token_tensor(flat, params.vocab_size, "ban-words", params.device)  # refuses bad ids
        self._banned = torch.zeros(params.vocab_size, dtype=torch.bool, device=params.device)
        """[vocab] tokens masked at every step (the one-token sequences)."""
        self._banned[[s[0] for s in sequences if len(s) == 1]] = True
        self._any_banned = any(len(s) == 1 for s in sequences)
        self._last_tokens: dict[tuple[int, ...], set[int]] = {}
        """Prefix of a multi-token sequence -> the last tokens masked after it."""
        for sequence in sequences:
            if len(sequence) > 1:
                self._last_tokens.setdefault(sequence[:-1], set()).add(sequence[-1])
        self._prefix_lengths = sorted({len(prefix) for prefix in self._last_tokens})
        self._history_len = max(self._prefix_lengths, default=0)
        self._tracked = torch.zeros(params.max_num_seqs, dtype=torch.bool, device=params.device)
        """[max_num_seqs] rows added (the mask of single tokens applies to these only)."""
        self._rows: set[int] = set()
        self._history: dict[int, list[int]] = {}
        """Row -> its last ``history_len`` output tokens (multi-token words only)."""
        self._step: tuple[torch.Tensor, torch.Tensor] | None = None
        """This step's (sampled-row index, token) pairs to mask, from :meth:`begin_step`."""

    def add(self, row: int, request: Request) -> None:
        """Track ``row``; after a preemption its emitted tokens seed the word matching."""
        self._rows.add(row)
        self._tracked[row] = True
        if self._history_len:
            self._history[row] = request.output_token_ids[-self._history_len :]

    def remove(self, row: int) -> None:
        """Forget ``row``."""
        self._rows.discard(row)
        self._tracked[row] = False
        self._history.pop(row, None)

    def is_position_independent(self, request: Request) -> bool:
        """True without multi-token words: the same tokens are banned at every position."""
        return not self._history_len

    @property
    def is_active(self) -> bool:
        """True while a row is added and there is anything to ban."""
        return bool(self._rows) and (self._any_banned or bool(self._last_tokens))

    def begin_step(self, rows: Sequence[int]) -> None:
        """Find the rows whose output ends with a banned sequence's prefix (host-side)."""
        self._step = None
        if not self._last_tokens:
            return
        indices: list[int] = []
        tokens: list[int] = []
        for index, row in enumerate(rows):
            history = self._history.get(row)
            if not history:
                continue
            for length in self._prefix_lengths:
                if length > len(history):
                    break
                for token in self._last_tokens.get(tuple(history[-length:]), ()):
                    indices.append(index)
                    tokens.append(token)
        if indices:
            self._step = (
                torch.tensor(indices, dtype=torch.int64, device=self._device),
                torch.tensor(tokens, dtype=torch.int64, device=self._device),
            )

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Set the banned tokens of the tracked rows among ``rows`` [S] to -inf in place."""
        if self._any_banned:
            tracked = self._tracked[rows].unsqueeze(1)  # [S, 1]
            logits.masked_fill_(tracked & self._banned, float("-inf"))  # [S, vocab]
        if self._step is not None:
            indices, tokens = self._step
            self._step = None
            logits[indices, tokens] = float("-inf")
        return logits

    def accept_batch(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Remember each row's last tokens (nothing to do without multi-token words)."""
        if not self._history_len:
            return
        keep = self._history_len + MAX_ROLLBACK
        for row, token in zip(rows, token_ids, strict=True):
            history = self._history.get(row)
            if history is not None:
                history.append(token)
                if len(history) > 2 * keep:
                    del history[:-keep]

    def rollback(self, row: int, num_tokens: int) -> None:
        """Forget the row's last ``num_tokens`` tokens (speculative decoding)."""
        history = self._history.get(row)
        if history is not None and num_tokens > 0:
            del history[-num_tokens:]

    def accept(self, row: int, token_ids: Sequence[int]) -> None:
        """Remember ``token_ids`` for ``row``."""
        self.accept_batch([row] * len(token_ids), token_ids)


def _tokenize(params: SamplerParams, words: Sequence[str]) -> set[tuple[int, ...]]:
    """The token sequences of ``words``, each as written and after a space."""
    if not words:
        return set()
    tokenizer = params.checkpoint.tokenizer() if params.checkpoint is not None else None
    if tokenizer is None:
        raise ValueError(
            f"ban-words: words {list(words)[:4]} need the model's tokenizer, and this engine "
            "has none; ban token_ids instead"
        )
    sequences: set[tuple[int, ...]] = set()
    for word in words:
        for text in {word, word if word.startswith(" ") else " " + word}:
            sequence = tuple(tokenizer.encode(text, add_special_tokens=False))
            if sequence:
                sequences.add(sequence)
    return sequences
