"""The whole forward of a split model under ``torch.compile``, attention left to the backend.

Inductor fuses the dense work between attention calls (norms, RoPE, SiLU-and-multiply,
residual adds) into a few C++ loops per layer and, with freezing, prepacks every linear
layer's weights for oneDNN/MKL; the step's Python dispatch of several hundred small ops
becomes one call. Attention stays whatever the configured backend does: it is an opaque
custom op (``brigade::attend``) whose implementation calls the backend's ``forward`` with the
step's metadata, so ragged batches, paged KV and every backend work unchanged.

The metadata is a Python object that cannot cross into a graph, so it travels beside it: a
context variable set for the duration of one forward (and reset afterwards) holds it, and the
op reads it there.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._dynamo

from brigade.cache import cache_root
from brigade.interfaces import SplitCausalLM

__all__ = ["CompiledForward"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _Step:
    model: SplitCausalLM
    metadata: Any


_STEP: contextvars.ContextVar[_Step] = contextvars.ContextVar("brigade_compiled_step")
"""The forward in progress (its model and attention metadata), for the attention op."""


@torch.library.custom_op("brigade::attend", mutates_args=("key_cache", "value_cache"))
def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layer_index: int,
) -> torch.Tensor:
    """Layer ``layer_index``'s attention through the model's backend (writes K/V in place)."""
    step = _STEP.get()
    return step.model.attend(
        layer_index, query, key, value, (key_cache, value_cache), step.metadata
    )


@_attend.register_fake
def _attend_shape(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layer_index: int,
) -> torch.Tensor:
    return torch.empty_like(query)


class CompiledForward:
    """``forward(input_ids, positions, kv_caches, metadata)`` of ``model``, compiled (the LM
    head stays eager: the model packs it for oneDNN itself, which beats inductor's GEMM).

    One graph with a dynamic token count serves every step (decode batches, prefill chunks,
    mixes of both; a count of 1 gets a graph of its own); compilation happens on the first
    calls. When compiling fails, the error is logged once and the model runs eagerly from then
    on (:attr:`failed` holds why).
    """

    def __init__(
        self,
        model: SplitCausalLM,
        num_layers: int,
        *,
        eager: Callable[..., torch.Tensor],
        freezing: bool = True,
    ) -> None:
        _persistent_cache()
        # Dynamo keys compiled code on the function's code object, which every instance
        # shares, and stops compiling past a few recompiles (each instance guards on its own
        # model): allow many engines per process (tests, notebooks) before that happens.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        self.model = model
        self.num_layers = num_layers
        self.eager = eager
        """The model's own forward: what runs after compiling failed."""
        self.failed: BaseException | None = None
        options: dict[str, str | int | bool | Callable[..., Any]] = {"freezing": freezing}
        self._compiled = torch.compile(self._forward, dynamic=True, fullgraph=True, options=options)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        model = self.model
        hidden, cos, sin = model.embed(input_ids, positions)
        for index in range(self.num_layers):
            q, k, v = model.attention_input(index, hidden, cos, sin)
            key_cache, value_cache = kv_caches[index]
            attention = torch.ops.brigade.attend(q, k, v, key_cache, value_cache, index)
            hidden = model.finish_layer(index, hidden, attention)
        return model.final_norm(hidden)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: Any,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden_size]."""
        if self.failed is None:
            token = _STEP.set(_Step(self.model, metadata))
            try:
                return self._compiled(input_ids, positions, kv_caches)
            except Exception as error:
                self._give_up(error)
            finally:
                _STEP.reset(token)
        return self.eager(input_ids, positions, kv_caches, metadata)

    def _give_up(self, error: Exception) -> None:
        """Fall back to eager for good on a compilation error; re-raise anything else."""
        import torch._dynamo.exc
        import torch._inductor.exc

        if not isinstance(
            error, torch._dynamo.exc.TorchDynamoException | torch._inductor.exc.CppCompileError
        ):
            raise error
        self.failed = error
        first_line = next(iter(str(error).strip().splitlines()), type(error).__name__)
        logger.warning(
            "torch.compile failed, so the model runs eagerly (slower); set [executor] "
            "compile = false to skip compiling. The error: %s",
            first_line,
        )


def _persistent_cache() -> None:
    """Keep inductor's caches beside Brigade's (``$BRIGADE_CACHE_DIR/inductor``) rather than
    in /tmp, so a restart reuses the compiled kernels; a user's TORCHINDUCTOR_CACHE_DIR wins."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
