"""The flat input of one forward pass (what the persistent batch hands the executor)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["ModelInput"]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInput:
    """Every scheduled token of one step, flattened, plus where its KV lives.

    Rows are requests; ``num_decodes`` leading rows have exactly one new token and the rest are
    prefill chunks (a chunk attends to the request's cached KV and causally to itself). A
    request that verifies draft tokens (speculative decoding, API 2.4) has one decode row per
    token: rows with the same block table and growing ``seq_lens``, each attending to the K/V
    that the rows before it write in the same step, so a backend must write every row's new
    K/V before it attends (as ``AttentionBackend.forward`` says) and must not assume that rows
    have distinct pages.
    Tensors are on the host when core builds them; the executor moves them to its device and
    keeps the ``*_cpu`` copies for host-side decisions. Shapes use T = num_tokens,
    B = num_reqs, S = number of positions whose logits are wanted, P = max pages per request.
    """

    input_ids: torch.Tensor
    """[T] int64 token ids."""
    positions: torch.Tensor
    """[T] int64 position of each token in its sequence."""
    query_start_loc: torch.Tensor
    """[B + 1] int32 offsets of each request's tokens in the flat arrays."""
    seq_lens: torch.Tensor
    """[B] int32 context length of each request after this step (cached + new tokens)."""
    block_tables: torch.Tensor
    """[B, P] int32 page ids of each request; entries past its pages are 0 (never read)."""
    slot_mapping: torch.Tensor
    """[T] int64 flat slot (page_id * page_size + offset) each new token's K/V is written to."""
    logits_indices: torch.Tensor
    """[S] int64 rows of the flat token array whose logits the step returns."""
    query_start_loc_cpu: torch.Tensor
    """Host copy of ``query_start_loc``."""
    seq_lens_cpu: torch.Tensor
    """Host copy of ``seq_lens``."""
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    page_size: int
    """Tokens per KV page: ``slot_mapping`` and ``block_tables`` are in these units, and a
    backend that gathers context by position (sdpa) needs it when it builds its metadata."""
    hidden_indices: torch.Tensor | None = None
    """[H] int64 rows of the flat token array whose final hidden states the step also
    returns (embedding requests; ``Executor.execute_with_hidden_states``), or None when no
    row of the step pools (API 2.1)."""

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        """Every row has one new token."""
        return self.num_decodes == self.num_reqs

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> ModelInput:
        """This batch with its device tensors on ``device``; the ``*_cpu`` host copies stay."""
        import torch  # at call time: the contracts import no torch at module load

        moved: dict[str, Any] = {
            field.name: value.to(device, non_blocking=non_blocking)
            for field in dataclasses.fields(self)
            if not field.name.endswith("_cpu")
            and isinstance(value := getattr(self, field.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)
