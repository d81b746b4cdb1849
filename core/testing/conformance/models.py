"""Conformance of the model side: attention backends, executors, model architectures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from brigade.interfaces import (
    AttentionBackend,
    Executor,
    ExecutorParams,
    KVCacheSpec,
    ModelArchitecture,
    ModelInput,
    NoOptions,
)
from brigade.model_input import SeqChunk, build_model_input
from brigade.testing.attention import naive_attention, random_attention_case, run_backend

__all__ = [
    "ATTENTION_CASES",
    "check_attention_backend",
    "check_executor",
    "check_model_architecture",
]

ATTENTION_CASES: tuple[dict[str, Any], ...] = (
    # decodes only, contexts ending mid-page and on a page boundary
    {"query_lens": [1, 1, 1], "num_computed": [4, 16, 1], "num_heads": 4, "num_kv_heads": 4},
    # whole prompts in one chunk each, grouped-query attention
    {"query_lens": [7, 1, 13], "num_computed": [0, 0, 0], "num_heads": 8, "num_kv_heads": 2},
    # decodes first, then chunks that continue a cached prefix
    {"query_lens": [1, 1, 6, 9], "num_computed": [9, 30, 5, 0], "num_heads": 8, "num_kv_heads": 1},
)
"""Ragged batches every attention backend must get right (per page size and head dim)."""


def check_attention_backend(
    backend: AttentionBackend,
    *,
    page_sizes: Sequence[int] | None = None,
    head_dims: Sequence[int] = (64, 128),
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    atol: float = 1e-4,
) -> None:
    """Compare ``backend`` with the naive reference on :data:`ATTENTION_CASES`.

    Also checks that the new K/V land at ``slot_mapping`` and that nothing else in the pool
    changes, and (when ``supports_sliding_window``) a sliding-window layer. ``page_sizes``
    defaults to those of 1, 4, 16, 256 the backend declares it can read.
    """
    rule = type(backend).supported_page_sizes(getattr(backend, "options", NoOptions()))
    sizes = list(page_sizes or [p for p in (1, 4, 16, 256) if rule.allows(p)])
    assert sizes, f"{type(backend).__name__}: none of the page sizes to test is allowed"
    windows: list[int | None] = [None, 5] if backend.supports_sliding_window else [None]
    for page_size in sizes:
        for head_dim in head_dims:
            for window in windows:
                for index, case_args in enumerate(ATTENTION_CASES):
                    label = f"case {index}, page_size {page_size}, head_dim {head_dim}"
                    label += f", window {window}" if window else ""
                    _check_attention_case(
                        backend,
                        random_attention_case(
                            **case_args,
                            head_dim=head_dim,
                            page_size=page_size,
                            sliding_window=window,
                            dtype=dtype,
                            device=device,
                            seed=index,
                        ),
                        atol,
                        label,
                    )


def _check_attention_case(backend: AttentionBackend, case: Any, atol: float, label: str) -> None:
    key_pool, _ = case.kv_cache
    expected_shape = tuple(key_pool.shape)
    actual_shape = backend.kv_cache_shape(*expected_shape)
    assert actual_shape == expected_shape, (
        f"{label}: the conformance cases use the layout {expected_shape}; backend asks "
        f"for {actual_shape}"
    )
    output, (keys_after, values_after) = run_backend(backend, case)
    assert output.shape == case.query.shape, f"{label}: output shape {tuple(output.shape)}"
    assert torch.isfinite(output).all(), f"{label}: non-finite output (read an unwritten slot?)"
    expected = naive_attention(case).to(output.device)
    error = float((output.double() - expected).abs().max())
    assert error <= atol, f"{label}: max |error| {error:.3g} > {atol} against the reference"
    slots = case.batch.slot_mapping
    for name, before, after, new in (
        ("K", case.kv_cache[0], keys_after, case.key),
        ("V", case.kv_cache[1], values_after, case.value),
    ):
        flat_after = after.reshape(-1, *after.shape[2:])  # [slots, kv_heads, head_dim]
        flat_before = before.reshape(-1, *before.shape[2:])  # [slots, kv_heads, head_dim]
        assert torch.equal(flat_after[slots], new.to(after.dtype)), (
            f"{label}: new {name} not written at slot_mapping"
        )
        untouched = torch.ones(flat_after.shape[0], dtype=torch.bool, device=after.device)
        untouched[slots] = False
        assert torch.equal(
            flat_after[untouched].nan_to_num(7.0), flat_before[untouched].nan_to_num(7.0)
        ), f"{label}: {name} slots outside slot_mapping changed"


def check_executor(
    factory: Callable[[ExecutorParams, Any], Executor],
    options: Any,
    model_dir: str | Path,
    *,
    reference: Executor,
    page_size: int = 4,
    num_pages: int = 32,
    atol: float = 1e-4,
) -> None:
    """Run an executor built by ``factory`` next to ``reference`` on the same model.

    ``reference`` (e.g. the ``torch`` executor with ``sdpa``) must already have its KV cache
    initialised with at least ``num_pages`` pages of ``page_size``. Checks the KV spec, a
    ragged prefill, decodes across page boundaries, repeatability and, when supported,
    ``copy_pages``. An executor with ``returns_token_ids`` (no logits, e.g. a simulator) is
    checked for the token-id contract instead of logits parity. The executor gets its params
    as core builds them: the model opened once (``params.checkpoint``) and its architecture
    (``params.model_factory``) picked from the installed plugins.
    """
    executor = factory(_executor_params(model_dir, page_size), options)
    spec = executor.kv_cache_spec()
    _check_kv_cache_spec(spec, page_size)
    executor.initialize_kv_cache(num_pages)
    prompts = [[5, 17, 9, 3, 11], [2, 8, 30, 1, 7, 19, 4, 12, 6]]
    tables = [[3, 0], [5, 1, 7, 2]]  # shuffled, non-contiguous pages
    prefill = build_model_input(
        [SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)], page_size
    )
    if type(executor).returns_token_ids:
        _check_token_ids(executor, prefill, spec.vocab_size)
        executor.shutdown()
        return
    logits = executor.execute(prefill)
    assert logits.dtype == torch.float32, f"logits dtype {logits.dtype}, expected float32"
    assert logits.shape == (2, spec.vocab_size), f"logits shape {tuple(logits.shape)}"
    _assert_close(logits, reference.execute(prefill), atol, "prefill")
    decode = build_model_input(
        [SeqChunk([7], len(p), t) for p, t in zip(prompts, tables, strict=True)], page_size
    )
    first = executor.execute(decode)
    _assert_close(first, reference.execute(decode), atol, "decode")
    _assert_close(executor.execute(decode), first, 0.0, "repeating the same step")
    if type(executor).supports_copy_pages:
        executor.copy_pages([3, 0], [9, 10])
        forked = build_model_input([SeqChunk([7], len(prompts[0]), [9, 10])], page_size)
        _assert_close(executor.execute(forked), first[:1], atol, "decode over copied pages")
    executor.shutdown()


def _executor_params(model_dir: str | Path, page_size: int) -> ExecutorParams:
    """An executor's params as core builds them: the model opened once, its architecture
    picked from the installed plugins; float32 weights, ``cpu`` attention (its C++ kernels)."""
    from brigade.assemble import model_architecture
    from brigade.models.checkpoint import open_checkpoint
    from brigade.registry import default_registry

    checkpoint = open_checkpoint(str(model_dir))
    return ExecutorParams(
        model_path=checkpoint.path,
        dtype="float32",
        attention=_cpu_attention(),
        page_size=page_size,
        kv_cache_dtype="auto",
        max_model_len=0,
        model_factory=model_architecture(checkpoint, default_registry()),
        checkpoint=checkpoint,
    )


def _check_kv_cache_spec(spec: KVCacheSpec, page_size: int) -> None:
    assert spec.page_size == page_size, f"kv_cache_spec page_size {spec.page_size}"
    for field in ("bytes_per_page", "num_layers", "max_model_len", "vocab_size"):
        assert getattr(spec, field) > 0, f"kv_cache_spec: implausible {field} in {spec}"


def _check_token_ids(executor: Executor, batch: ModelInput, vocab_size: int) -> None:
    token_ids = executor.execute(batch)
    wanted = (batch.logits_indices.shape[0],)
    assert token_ids.dtype == torch.int64, f"token ids dtype {token_ids.dtype}, expected int64"
    assert token_ids.shape == wanted, f"token ids shape {tuple(token_ids.shape)} != {wanted}"
    assert bool(((token_ids >= 0) & (token_ids < vocab_size)).all()), (
        f"token ids outside the vocabulary [0, {vocab_size}): {token_ids.tolist()}"
    )


def check_model_architecture(
    architecture: ModelArchitecture, model_dir: str | Path, *, atol: float = 1e-4
) -> None:
    """Brigade's build of ``model_dir`` must give transformers' fp32 logits.

    Needs transformers to know the architecture; compares a ragged prefill batch and a
    decode step over paged KV.
    """
    from transformers import AutoModelForCausalLM

    from brigade.models.checkpoint import open_checkpoint
    from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions

    hf_model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    checkpoint = open_checkpoint(str(model_dir))
    params = ExecutorParams(
        model_path=checkpoint.path,
        dtype="float32",
        attention=_cpu_attention(),
        page_size=4,
        kv_cache_dtype="auto",
        max_model_len=0,
        model_factory=architecture,
        checkpoint=checkpoint,
    )
    executor = TorchExecutor(params, TorchExecutorOptions(device="cpu"))
    executor.initialize_kv_cache(16)
    sequences = [[5, 17, 9, 3, 11, 40], [2, 8, 30, 1, 7, 19, 4, 12, 6, 21]]
    tables = [[4, 1], [0, 6, 2]]
    prefill = [
        SeqChunk(s[:-1], 0, t, want_logits="all") for s, t in zip(sequences, tables, strict=True)
    ]
    decode = [SeqChunk(s[-1:], len(s) - 1, t) for s, t in zip(sequences, tables, strict=True)]
    actual = torch.cat([executor.execute(build_model_input(step, 4)) for step in (prefill, decode)])
    with torch.no_grad():
        full = [hf_model(torch.tensor([s])).logits[0].float() for s in sequences]
    expected = torch.cat([f[:-1] for f in full] + [f[-1:] for f in full])
    _assert_close(actual, expected, atol, "logits vs transformers")


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    error = float((actual.float().cpu() - expected.float().cpu()).abs().max())
    assert error <= atol, f"{what}: max |difference| {error:.3g} > {atol}"


def _cpu_attention() -> AttentionBackend:
    from brigade.plugins.cpu import CpuAttentionBackend

    return CpuAttentionBackend(NoOptions())
