"""Brigade's model path (loader, decoder, sdpa over paged KV) against transformers, in fp32.

Every test compares logits of fixed token sequences with transformers' eager implementation
run on each whole sequence alone. Batches are ragged, pages small (4 tokens) and shuffled,
so page boundaries, non-contiguous block tables and chunked prefills are all exercised.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import build_hf_model, save_model
from executor_helpers import (
    ATOL,
    NUM_PAGES,
    PAGE_SIZE,
    ShuffledPages,
    make_executor,
    token_sequences,
)
from safetensors import safe_open

from brigade.interfaces import ExecutorParams, NoOptions
from brigade.model_input import SeqChunk, build_model_input
from brigade.models.checkpoint import open_checkpoint
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions
from brigade.plugins.models.rope import parse_rope_config, rope_cos_sin
from brigade.testing.parity import assert_greedy_match


@dataclasses.dataclass(frozen=True)
class Variant:
    family: str
    config: dict[str, Any]
    storage_dtype: torch.dtype | None = None
    legacy_rope_key: bool = False
    """Rewrite config.json's rope_scaling with only the old ``type`` key."""


VARIANTS = {
    "llama": Variant("llama", {"num_key_value_heads": 4}),
    "llama-gqa4-bias": Variant(
        "llama",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "mistral-window8": Variant("mistral", {"sliding_window": 8, "head_dim": 32}),
    "qwen2": Variant("qwen2", {}),
    "qwen2-window-upper-layer": Variant(
        "qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}
    ),
    "qwen3": Variant("qwen3", {"head_dim": 32, "num_key_value_heads": 1}),
    "llama3-rope-old-config": Variant(
        "llama",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_type": "llama3",
            },
        },
    ),
    "yarn-rope": Variant(
        "qwen2",
        {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
        legacy_rope_key=True,
    ),
    "linear-rope": Variant(
        "llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, legacy_rope_key=True
    ),
    "llama-tied": Variant("llama", {"tie_word_embeddings": True}),
    "llama-bf16-stored": Variant("llama", {}, storage_dtype=torch.bfloat16),
}


MODES: dict[str, dict[str, Any]] = {
    "eager": {"native_decode": True, "cpu_linear": "panels", "fused": True},
    "gather": {"native_decode": False, "cpu_linear": "plain", "fused": False},
}
"""How the CPU forward runs: the default fast path (decode and prefill attention in the C++
kernels that read pages in place, float32 linear layers through Brigade's panel GEMM and
bfloat16 ones through it too, or its AMX tile GEMM where the CPU has AMX (test_cpu_gemm.py
compares them with oneDNN's),
norms/SiLU-mul/RoPE in the fused C++ kernels), or the reference path (pages gathered for SDPA,
F.linear, torch's operations).
The compiled forward is checked against the eager one in test_compiled.py."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Path]]:
    """``checkpoints(variant)``: (transformers model in fp32, its saved directory), once."""
    made: dict[str, tuple[Any, Path]] = {}

    def get(name: str) -> tuple[Any, Path]:
        if name not in made:
            variant = VARIANTS[name]
            hf_model = build_hf_model(variant.family, **variant.config)
            directory = tmp_path_factory.mktemp(name)
            save_model(hf_model, directory, variant.storage_dtype)
            if variant.legacy_rope_key:
                _keep_only_legacy_rope_type(directory)
            made[name] = (hf_model, directory)
        return made[name]

    return get


@pytest.fixture(scope="module")
def executors(
    checkpoints: Callable[[str], tuple[Any, Path]],
) -> Callable[[str, str], TorchExecutor]:
    """``executors(variant, mode)``: one executor per pair for the module (tests write only
    pages they read back themselves)."""
    made: dict[tuple[str, str], TorchExecutor] = {}

    def get(variant: str, mode: str) -> TorchExecutor:
        if (variant, mode) not in made:
            made[variant, mode] = make_executor(checkpoints(variant)[1], **MODES[mode])
        return made[variant, mode]

    return get


@pytest.fixture(params=[(v, m) for m in MODES for v in VARIANTS], ids="-".join)
def model_pair(
    request: pytest.FixtureRequest,
    checkpoints: Callable[[str], tuple[Any, Path]],
    executors: Callable[[str, str], TorchExecutor],
) -> Any:
    """(transformers model in fp32, brigade executor on the same checkpoint, in one mode)."""
    name, mode = request.param
    variant = VARIANTS[name]
    hf_model, directory = checkpoints(name)
    stored = safe_open(str(directory / "model.safetensors"), framework="pt")
    if variant.config.get("tie_word_embeddings"):
        assert "lm_head.weight" not in set(stored.keys()), "tied checkpoint should omit lm_head"
    if variant.storage_dtype is not None:
        assert stored.get_tensor("model.norm.weight").dtype == variant.storage_dtype
    return hf_model, executors(name, mode)


def _keep_only_legacy_rope_type(directory: Path) -> None:
    """Rewrite config.json as transformers 4.x wrote it: ``rope_theta`` beside a
    ``rope_scaling`` dict with only the old ``type`` key (transformers 5 writes one
    ``rope_parameters`` dict)."""
    file = directory / "config.json"
    config = json.loads(file.read_text())
    params = dict(config.pop("rope_parameters", None) or config.get("rope_scaling") or {})
    config["rope_theta"] = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", None) or params.pop("type", None)
    config["rope_scaling"] = {"type": kind, **params}
    file.write_text(json.dumps(config))


def reference_logits(hf_model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """transformers' fp32 logits [len(tokens), vocab] for one whole sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([list(tokens)])).logits[0].float()


def test_prefill_of_a_ragged_batch(model_pair: Any) -> None:
    hf_model, executor = model_pair
    prompts = token_sequences([5, 11, 19])
    pages = ShuffledPages()
    chunks = [SeqChunk(p, 0, pages.take(len(p)), want_logits="all") for p in prompts]
    logits = executor.execute(build_model_input(chunks, PAGE_SIZE))
    expected = torch.cat([reference_logits(hf_model, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_decode_steps_across_page_boundaries(model_pair: Any) -> None:
    hf_model, executor = model_pair
    prompt_lens, num_steps = [5, 11, 17], 7
    sequences = token_sequences([n + num_steps for n in prompt_lens])
    pages = ShuffledPages(seed=3)
    tables = [pages.take(len(s)) for s in sequences]
    chunks = [SeqChunk(s[:n], 0, t) for s, n, t in zip(sequences, prompt_lens, tables, strict=True)]
    outputs = [executor.execute(build_model_input(chunks, PAGE_SIZE))]
    for step in range(num_steps):
        chunks = [
            SeqChunk([s[n + step]], n + step, t)
            for s, n, t in zip(sequences, prompt_lens, tables, strict=True)
        ]
        outputs.append(executor.execute(build_model_input(chunks, PAGE_SIZE)))
    actual = torch.stack(outputs, dim=1)  # [num_seqs, num_steps + 1, vocab]
    expected = torch.stack(
        [
            reference_logits(hf_model, s)[n - 1 :]
            for s, n in zip(sequences, prompt_lens, strict=True)
        ]
    )
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def test_chunked_prefill_mixed_with_decodes(model_pair: Any) -> None:
    hf_model, executor = model_pair
    a, b, c = token_sequences([8, 6, 17], seed=5)
    pages = ShuffledPages(seed=7)
    table_a, table_b, table_c = pages.take(8), pages.take(6), pages.take(17)
    steps = [
        [SeqChunk(a[:6], 0, table_a), SeqChunk(c[:7], 0, table_c, want_logits="all")],
        [  # a decodes while c's second chunk reads the first chunk's KV and b starts fresh
            SeqChunk(a[6:7], 6, table_a),
            SeqChunk(c[7:16], 7, table_c, want_logits="all"),
            SeqChunk(b[:5], 0, table_b, want_logits="all"),
        ],
        [
            SeqChunk(a[7:8], 7, table_a),
            SeqChunk(c[16:17], 16, table_c),
            SeqChunk(b[5:6], 5, table_b),
        ],
    ]
    actual = torch.cat([executor.execute(build_model_input(s, PAGE_SIZE)) for s in steps])
    ref_a, ref_b, ref_c = (reference_logits(hf_model, s) for s in (a, b, c))
    expected = torch.cat(
        [
            ref_a[5:6],
            ref_c[:7],
            ref_a[6:7],
            ref_c[7:16],
            ref_b[:5],
            ref_a[7:8],
            ref_c[16:17],
            ref_b[5:6],
        ]
    )
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def greedy_staggered(
    executor: TorchExecutor, prompts: Sequence[list[int]], num_new: int, chunk: int = 5
) -> list[list[int]]:
    """Greedy decoding where prompt i joins at step i and prefills in chunks of ``chunk``,
    so steps mix decodes, middle chunks and last chunks."""
    pages = ShuffledPages(seed=11)
    tables = [pages.take(len(p) + num_new) for p in prompts]
    prefilled, outputs = [0] * len(prompts), [[] for _ in prompts]
    step = 0
    while any(len(out) < num_new for out in outputs):
        rows: list[tuple[int, SeqChunk]] = []
        for i, prompt in enumerate(prompts):
            if step < i or len(outputs[i]) >= num_new:
                continue
            if prefilled[i] < len(prompt):
                start, end = prefilled[i], min(len(prompt), prefilled[i] + chunk)
                want = "last" if end == len(prompt) else "none"
                rows.append((i, SeqChunk(prompt[start:end], start, tables[i], want)))
                prefilled[i] = end
            else:
                position = len(prompt) + len(outputs[i]) - 1
                rows.append((i, SeqChunk([outputs[i][-1]], position, tables[i])))
        rows.sort(key=lambda row: not row[1].is_decode)  # decode rows first, as required
        logits = executor.execute(build_model_input([c for _, c in rows], PAGE_SIZE))
        sampled = [i for i, c in rows if c.want_logits != "none"]
        for i, token in zip(sampled, logits.argmax(dim=-1).tolist(), strict=True):
            outputs[i].append(token)
        step += 1
    return outputs


def test_greedy_generation_matches_transformers(model_pair: Any) -> None:
    hf_model, executor = model_pair
    num_new = 10
    prompts = token_sequences([6, 9, 13], seed=2)
    ours = greedy_staggered(executor, prompts, num_new)
    for prompt, tokens in zip(prompts, ours, strict=True):
        input_ids = torch.tensor([prompt])
        generated = hf_model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),  # token 0 is the pad id: still attend
            max_new_tokens=num_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        theirs = generated.sequences[0, len(prompt) :].tolist()
        assert len(set(theirs)) >= 4, f"uninformative continuation {theirs}"

        def score(step: int, token: int, logits: tuple = generated.logits) -> float:
            return float(logits[step][0, token])

        assert_greedy_match(tokens, theirs, score, atol=ATOL)


def test_rope_parameters_form_matches_rope_scaling_form() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    old = {"rope_theta": 500000.0, "rope_scaling": {**scaling, "rope_type": "llama3"}}
    new = {"rope_parameters": {**scaling, "rope_type": "llama3", "rope_theta": 500000.0}}
    plain = {"rope_theta": 500000.0}
    caches = [
        rope_cos_sin(parse_rope_config(config, 16, 128), torch.device("cpu"))
        for config in (old, new, plain)
    ]
    torch.testing.assert_close(caches[0], caches[1], atol=0, rtol=0)
    assert not torch.allclose(caches[0][0], caches[2][0]), "llama3 scaling changed nothing"


def test_copy_pages_forks_a_sequence(hf_model_dir: Callable[..., Any]) -> None:
    hf_model, directory = hf_model_dir("llama")
    executor = make_executor(directory)
    (sequence,) = token_sequences([11])
    pages = ShuffledPages(seed=13)
    parent, child = pages.take(11), pages.take(11)
    executor.execute(build_model_input([SeqChunk(sequence[:10], 0, parent)], PAGE_SIZE))
    executor.copy_pages(parent, child)
    # Both continue from the same 10 cached tokens: the child reads only its copied pages.
    batch = build_model_input(
        [SeqChunk(sequence[10:], 10, parent), SeqChunk(sequence[10:], 10, child)], PAGE_SIZE
    )
    expected = reference_logits(hf_model, sequence)[10:].expand(2, -1)
    torch.testing.assert_close(executor.execute(batch), expected, atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_executor_matches_transformers(hf_model_dir: Callable[..., Any]) -> None:
    hf_model, directory = hf_model_dir("qwen3", head_dim=32)
    params = ExecutorParams(
        model_path=str(directory),
        dtype="bfloat16",
        attention=SdpaBackend(NoOptions()),
        page_size=PAGE_SIZE,
        kv_cache_dtype="auto",
        max_model_len=0,
        checkpoint=open_checkpoint(str(directory)),
    )
    executor = TorchExecutor(params, TorchExecutorOptions(device="cuda"))
    executor.initialize_kv_cache(NUM_PAGES)
    prompts = token_sequences([5, 11, 19])
    pages = ShuffledPages()
    chunks = [SeqChunk(p, 0, pages.take(len(p)), want_logits="all") for p in prompts]
    logits = executor.execute(build_model_input(chunks, PAGE_SIZE))
    assert logits.device.type == "cuda"
    assert logits.dtype == torch.float32
    expected = torch.cat([reference_logits(hf_model, p) for p in prompts])
    # bf16 weights and activations: compared by tolerance only
    torch.testing.assert_close(logits.cpu(), expected, atol=0.3, rtol=0)


def test_build_model_input_layout() -> None:
    batch = build_model_input(
        [
            SeqChunk([7], 5, [3, 0]),  # decode at position 5: page 0, offset 1
            SeqChunk([1, 2, 3], 2, [6, 4], want_logits="all"),  # a second chunk, 2 pages
            SeqChunk([4, 5], 0, [2], want_logits="none"),  # a first chunk, no logits
        ],
        page_size=4,
    )
    assert batch.input_ids.tolist() == [7, 1, 2, 3, 4, 5]
    assert batch.positions.tolist() == [5, 2, 3, 4, 0, 1]
    assert batch.slot_mapping.tolist() == [1, 26, 27, 16, 8, 9]
    assert batch.query_start_loc.tolist() == [0, 1, 4, 6]
    assert batch.seq_lens.tolist() == [6, 5, 2]
    assert batch.block_tables.tolist() == [[3, 0], [6, 4], [2, 0]]
    assert batch.logits_indices.tolist() == [0, 1, 2, 3]
    assert (batch.num_decodes, batch.max_query_len, batch.max_seq_len) == (1, 3, 6)
    assert batch.block_tables.dtype == batch.seq_lens.dtype == torch.int32
    assert batch.slot_mapping.dtype == batch.positions.dtype == torch.int64


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([SeqChunk([1, 2], 0, [0]), SeqChunk([3], 4, [1, 2])], "decode row after a prefill"),
        ([SeqChunk([1] * 5, 0, [0])], "need 2 pages of 4, but its block_table has 1"),
        ([SeqChunk([], 0, [0])], "token_ids is empty"),
    ],
)
def test_build_model_input_refuses(chunks: list[SeqChunk], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model_input(chunks, page_size=4)


@pytest.mark.parametrize("name", ["llama", "llama-gqa4-bias", "mistral-window8", "qwen2", "qwen3"])
@pytest.mark.parametrize("cpu_linear", ["panels", "packed"])
def test_bfloat16_on_a_cpu_is_as_close_to_fp32_as_transformers_in_bfloat16(
    checkpoints: Callable[[str], tuple[Any, Path]], name: str, cpu_linear: str
) -> None:
    """bf16 is compared by tolerance only: Brigade's CPU fast path in bf16 (GEMMs on the panels,
    or on AMX the tile GEMM, or oneDNN's on packed weights; fused kernels, the fused decode step)
    must stray from the fp32 logits no further than transformers' own model does in bf16, over a
    ragged prefill and decode steps."""
    hf_model, directory = checkpoints(name)
    executor = make_executor(directory, dtype="bfloat16", cpu_linear=cpu_linear)
    hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    prompt_lens, num_steps = [5, 11, 17], 5
    sequences = token_sequences([n + num_steps for n in prompt_lens], seed=9)
    pages = ShuffledPages(seed=11)
    tables = [pages.take(len(s)) for s in sequences]
    chunks = [SeqChunk(s[:n], 0, t) for s, n, t in zip(sequences, prompt_lens, tables, strict=True)]
    outputs = [executor.execute(build_model_input(chunks, PAGE_SIZE))]
    for step in range(num_steps):
        chunks = [
            SeqChunk([s[n + step]], n + step, t)
            for s, n, t in zip(sequences, prompt_lens, tables, strict=True)
        ]
        outputs.append(executor.execute(build_model_input(chunks, PAGE_SIZE)))
    actual = torch.stack(outputs, dim=1)  # [num_seqs, num_steps + 1, vocab]
    exact, theirs = (
        torch.stack(
            [
                reference_logits(model, s)[n - 1 :]
                for s, n in zip(sequences, prompt_lens, strict=True)
            ]
        )
        for model in (hf_model, hf_bf16)
    )
    our_error = (actual - exact).abs().max().item()
    their_error = (theirs - exact).abs().max().item()
    assert 0 < our_error <= 1.5 * their_error + 0.02, (
        f"bf16 logits stray {our_error:.3f} from fp32, transformers' bf16 {their_error:.3f}"
    )
