"""GGUF models: every tensor type and architecture loads as the original, the parser agrees
with the gguf package, and every unloadable file gets a clear error.

Tiny random HF models (``brigade.models.create``) are converted by
``brigade.testing.gguf_export`` the way llama.cpp's converter does, then read through Brigade
(``open_gguf``, ``gguf_hf_config``, ``gguf_weights``) and, independently, through the gguf
package (``GGUFReader`` + ``gguf.quants.dequantize``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from executor_helpers import ATOL, PAGE_SIZE, ShuffledPages, make_executor, token_sequences
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from brigade.errors import ModelLoadError
from brigade.model_input import SeqChunk, build_model_input
from brigade.models.checkpoint import default_model_file
from brigade.models.create import create_model
from brigade.models.gguf import SUPPORTED_TENSOR_TYPES, open_gguf
from brigade.models.gguf_weights import gguf_hf_config, gguf_weights
from brigade.testing.gguf_export import quantize, write_gguf

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
QUANTIZED_TYPES = [t for t in SUPPORTED_TENSOR_TYPES if t not in FLOAT_TYPES]

REL_RMS_BOUND: dict[str, tuple[float, float]] = {
    "Q8_0": (0.0065, 0.020),
    "Q6_K": (0.021, 0.055),
    "Q5_1": (0.044, 0.090),
    "Q5_K": (0.041, 0.088),
    "Q5_0": (0.049, 0.14),
    "Q4_1": (0.090, 0.20),
    "Q4_K": (0.085, 0.19),
    "Q4_0": (0.099, 0.22),
    "Q3_K": (0.17, 0.24),
    "Q2_K": (0.34, 0.47),
}
"""Bounds on the relative RMS error ||dequantize(quantize(x)) - x|| / ||x|| per type, as
(for x ~ N(0, 1), for the other values when 0.2% of N(0, 1) values are outliers 30x larger).
About 15% above what test_quantizers_stay_within_their_error_bound measures on 512 x 1024
values; a model's N(0, sigma) weight matrices must meet the first bound too."""

SHAPE = {"num_hidden_layers": 2, "intermediate_size": 256}
"""Every matrix row (hidden 256, intermediate 256, heads x head_dim 256 or 512) is a
multiple of the K-quants' 256-value blocks."""
VARIANTS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "llama": ("llama", {}, False),  # the one untied lm_head (output.weight)
    "mistral": ("mistral", {}, True),
    # q/k/v biases; tied embeddings (as Qwen2-0.5B), which also halves the test's work
    "qwen2": ("qwen2", {}, True),
    # 8 heads x head_dim 64 != hidden 256, so key_length matters; tied embeddings
    "qwen3": ("qwen3", {"num_attention_heads": 8, "num_key_value_heads": 2}, True),
    # llama's q/k biases are permuted like its weights
    "llama-bias-tied": ("llama", {"attention_bias": True, "mlp_bias": True}, True),
    # Llama 3.1's RoPE scaling, which a GGUF carries as a rope_freqs tensor of divisors; a
    # short original context so most frequencies are scaled
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        True,
    ),
}
"""name -> (create_model arch, config overrides beyond SHAPE, tie_word_embeddings)."""
CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``model_dir(variant)``: the variant's HF directory, created once per module."""
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            arch, overrides, tied = VARIANTS[variant]
            made[variant] = create_model(
                tmp_path_factory.mktemp(variant),
                arch,
                seed=len(made),
                tie_word_embeddings=tied,
                overrides={**SHAPE, **overrides},
            )
        return made[variant]

    return get


@pytest.fixture(scope="module")
def gguf_path(
    model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    """``gguf_path(variant, tensor_type)``: the variant written as GGUF, once per module."""
    written: dict[tuple[str, str], Path] = {}
    out = tmp_path_factory.mktemp("gguf")

    def get(variant: str, tensor_type: str) -> Path:
        key = (variant, tensor_type)
        if key not in written:
            target = out / f"{variant}-{tensor_type}.gguf"
            written[key] = write_gguf(
                model_dir(variant), target, tensor_type=tensor_type, tokenizer=False
            )
        return written[key]

    return get


def rel_rms(approx: torch.Tensor | np.ndarray, exact: torch.Tensor | np.ndarray) -> float:
    """||approx - exact|| / ||exact||."""
    approx_t, exact_t = torch.as_tensor(approx), torch.as_tensor(exact)
    return float(torch.linalg.vector_norm(approx_t - exact_t) / torch.linalg.vector_norm(exact_t))


def hf_rows(num_heads: int, head_dim: int) -> np.ndarray:
    """Indices that put a llama.cpp q/k matrix's rows in transformers' order. llama.cpp
    interleaves rotate_half's two halves: per head, HF row i is at 2i, head_dim/2 + i at 2i+1."""
    half = head_dim // 2
    within = np.arange(head_dim)
    stored_at = (within % half) * 2 + within // half  # [head_dim]
    return (np.arange(num_heads)[:, None] * head_dim + stored_at).reshape(-1)


def read_with_gguf_package(
    path: Path, original: dict[str, torch.Tensor]
) -> dict[str, tuple[str, torch.Tensor]]:
    """The GGUF's tensors under the HF names of ``original``, read and dequantized by the gguf
    package alone (q/k rows back in transformers' order for llama): {name: (type, tensor)}."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    num_layers = reader.fields[f"{arch}.block_count"].contents()
    heads = {
        "q_proj": reader.fields[f"{arch}.attention.head_count"].contents(),
        "k_proj": reader.fields[f"{arch}.attention.head_count_kv"].contents(),
    }
    # rope_freqs holds RoPE scaling (Llama 3), not a weight
    stored = {t.name: t for t in reader.tensors if t.name != "rope_freqs.weight"}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)
    result: dict[str, tuple[str, torch.Tensor]] = {}
    for name in original:
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf has no name for {name}"
        tensor = stored.pop(gguf_name)
        # a plain array: dequantize splits it in row groups, slow on the reader's memmap
        values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type)
        values = values.reshape(tuple(reversed(tensor.shape.tolist())))
        projection = name.split(".")[-2]
        if arch == "llama" and projection in heads:
            num_heads = heads[projection]
            values = values[hf_rows(num_heads, values.shape[0] // num_heads)]
        result[name] = (tensor.tensor_type.name, torch.from_numpy(np.array(values)))
    assert not stored, f"tensors without an HF counterpart: {sorted(stored)}"
    return result


def load(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What Brigade loads from ``path``: (HF config, HF-named float32 weights)."""
    with open_gguf(path) as file:
        config = gguf_hf_config(file)
        return config, dict(gguf_weights(file, config, torch.float32, "cpu"))


def write_out(writer: gguf.GGUFWriter, path: Path) -> Path:
    """Write what was added to ``writer`` to ``path``."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("tensor_type", SUPPORTED_TENSOR_TYPES)
@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_type_and_architecture_loads_the_original_weights(
    variant: str,
    tensor_type: str,
    model_dir: Callable[[str], Path],
    gguf_path: Callable[[str, str], Path],
) -> None:
    directory = model_dir(variant)
    original = load_file(directory / "model.safetensors")
    expected_config = json.loads((directory / "config.json").read_text())
    with open_gguf(gguf_path(variant, tensor_type)) as file:
        config = gguf_hf_config(file)
        loaded = dict(gguf_weights(file, config, torch.float32, "cpu"))
    for key in CONFIG_KEYS:
        assert config[key] == expected_config[key], key
    assert config["rms_norm_eps"] == pytest.approx(expected_config["rms_norm_eps"], rel=1e-6)
    assert (
        config["rope_parameters"]["rope_theta"] == expected_config["rope_parameters"]["rope_theta"]
    )
    assert set(loaded) == set(original), "tensor names differ from the original's"
    assert ("lm_head.weight" in loaded) == (not VARIANTS[variant][2])

    from_file = read_with_gguf_package(gguf_path(variant, tensor_type), original)
    bound = REL_RMS_BOUND.get(tensor_type, (0.0, 0.0))[0]
    for name, weight in original.items():
        stored_type, stored = from_file[name]
        assert stored_type == (tensor_type if weight.ndim == 2 else "F32"), name
        assert torch.equal(loaded[name], stored.float()), f"{name}: Brigade != gguf package"
        if stored_type == "F32":
            assert torch.equal(stored, weight), name  # proves the q/k permutation round trip
        elif stored_type in FLOAT_TYPES:
            assert torch.equal(stored.float(), weight.to(FLOAT_TYPES[stored_type]).float()), name
        else:
            assert rel_rms(stored, weight) <= bound, f"{name}: {rel_rms(stored, weight):.4f}"


def test_llama_q_k_biases_are_permuted_and_tied_embeddings_omit_the_head(
    model_dir: Callable[[str], Path], gguf_path: Callable[[str, str], Path]
) -> None:
    original = load_file(model_dir("llama-bias-tied") / "model.safetensors")
    path = gguf_path("llama-bias-tied", "F32")
    config, loaded = load(path)
    assert config["attention_bias"]
    assert config["mlp_bias"]
    assert config["tie_word_embeddings"]
    assert set(loaded) == set(original)
    for name, weight in original.items():
        assert torch.equal(loaded[name], weight), name
    hf_bias = original["model.layers.0.self_attn.k_proj.bias"]
    with open_gguf(path) as file:
        assert "output.weight" not in file.tensors
        tensor = file.tensors["blk.0.attn_k.bias"]
        as_stored = torch.frombuffer(bytearray(file.data(tensor)), dtype=torch.float32)
    assert not torch.equal(as_stored, hf_bias), "the k bias was stored unpermuted"
    assert torch.equal(
        as_stored[hf_rows(config["num_key_value_heads"], config["head_dim"])], hf_bias
    )


@pytest.mark.parametrize(
    ("arch", "rope_scaling"),
    [
        ("llama", {"rope_type": "linear", "factor": 2.0}),
        ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    ],
)
def test_rope_scaling_round_trips(arch: str, rope_scaling: dict[str, Any], tmp_path: Path) -> None:
    directory = create_model(
        tmp_path / arch, arch, overrides={**SHAPE, "rope_scaling": rope_scaling}
    )
    expected = json.loads((directory / "config.json").read_text())["rope_parameters"]
    config, _ = load(write_gguf(directory, tmp_path / "m.gguf", tokenizer=False))
    assert config["rope_parameters"] == expected
    assert expected["rope_type"] == rope_scaling["rope_type"]


# --- quantizers -----------------------------------------------------------------------------


def outlier_data(rng: np.random.Generator, shape: tuple[int, int]) -> tuple[np.ndarray, Any]:
    """N(0, 1) values with 0.2% of them 30x larger; returns (values, outlier mask)."""
    values = rng.standard_normal(shape).astype(np.float32)
    outliers = rng.random(shape) < 0.002
    values[outliers] *= 30
    return values, outliers


@pytest.mark.parametrize("tensor_type", QUANTIZED_TYPES)
def test_quantizers_stay_within_their_error_bound(tensor_type: str) -> None:
    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    normal_bound, outlier_bound = REL_RMS_BOUND[tensor_type]

    normal = rng.standard_normal((512, 1024)).astype(np.float32)
    raw = quantize(normal, tensor_type)
    assert raw.dtype == np.uint8
    assert raw.shape == gguf.quants.quant_shape_to_byte_shape(normal.shape, qtype)
    assert rel_rms(gguf.quants.dequantize(raw, qtype), normal) <= normal_bound

    values, outliers = outlier_data(rng, (512, 1024))
    restored = gguf.quants.dequantize(quantize(values, tensor_type), qtype)
    assert rel_rms(restored[~outliers], values[~outliers]) <= outlier_bound
    # The outliers themselves survive: each block's scale is set by its largest value.
    assert rel_rms(restored[outliers], values[outliers]) <= normal_bound


K_GRIDS = {  # name: (sub-block size, affine?, largest level q, largest sub-block scale)
    "Q2_K": (16, True, 3, 15),
    "Q3_K": (16, False, 3, 31),
    "Q4_K": (32, True, 15, 63),
    "Q5_K": (32, True, 31, 63),
    "Q6_K": (16, False, 31, 127),
}


def on_k_grid(tensor_type: str, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Values exactly representable in ``tensor_type``, every sub-block with its own scale
    (and min): x = d * scale * q - dmin * min, or x = d * scale * q with q's most negative
    level present and the super-block's largest scale the most negative one."""
    sub_size, affine, top, scale_top = K_GRIDS[tensor_type]
    subs = 256 // sub_size
    if affine:
        q = rng.integers(0, top + 1, (num_blocks, subs, sub_size))
        q[..., 0], q[..., 1] = 0, top  # both ends of the range occur
        scale = rng.integers(1, scale_top + 1, (num_blocks, subs, 1))
        minimum = rng.integers(0, scale_top + 1, (num_blocks, subs, 1))
        scale[:, 0], minimum[:, 0] = scale_top, scale_top
        values = 2.0**-6 * scale * q - 2.0**-7 * minimum
    else:
        q = rng.integers(-top, top + 1, (num_blocks, subs, sub_size))
        q[..., 0] = -top - 1  # the peak sits on the extra negative level
        scale = rng.integers(-scale_top, scale_top + 1, (num_blocks, subs, 1))
        scale[:, 0] = -scale_top - 1
        values = 2.0**-8 * scale * q
    return values.reshape(num_blocks, 256).astype(np.float32)


@pytest.mark.parametrize("tensor_type", list(K_GRIDS))
def test_k_quant_layout_reproduces_values_on_its_grid(tensor_type: str) -> None:
    """Any scale, min or level stored in the wrong place of ggml's block layout shows here."""
    values = on_k_grid(tensor_type, 64, np.random.default_rng(1))
    qtype = gguf.GGMLQuantizationType[tensor_type]
    restored = gguf.quants.dequantize(quantize(values, tensor_type), qtype)
    np.testing.assert_array_equal(restored, values)


# --- logits ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "tensor_type"),
    [
        ("llama", "F32"),
        ("llama", "Q8_0"),
        ("qwen3", "F32"),
        ("qwen3", "Q8_0"),
        ("llama3-rope", "F32"),
    ],
)
def test_logits_match_transformers_on_the_weights_the_file_holds(
    variant: str,
    tensor_type: str,
    model_dir: Callable[[str], Path],
    gguf_path: Callable[[str, str], Path],
) -> None:
    directory, path = model_dir(variant), gguf_path(variant, tensor_type)
    from_file = read_with_gguf_package(path, load_file(directory / "model.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        parameters = dict(reference.named_parameters())  # a tied lm_head is not listed
        assert set(parameters) == set(from_file)
        for name, parameter in parameters.items():
            parameter.copy_(from_file[name][1])
    executor = make_executor(path)  # TorchExecutor on the GGUF file, as core builds it

    prompts, num_steps = token_sequences([5, 11, 19], seed=4), 3
    pages = ShuffledPages(seed=2)
    tables = [pages.take(len(p) + num_steps) for p in prompts]
    chunks = [SeqChunk(p[:-num_steps], 0, t, "all") for p, t in zip(prompts, tables, strict=True)]
    outputs = [executor.execute(build_model_input(chunks, PAGE_SIZE))]
    for step in range(num_steps, 0, -1):  # decode the held-back tokens one at a time
        decodes = [
            SeqChunk([p[-step]], len(p) - step, t) for p, t in zip(prompts, tables, strict=True)
        ]
        outputs.append(executor.execute(build_model_input(decodes, PAGE_SIZE)))
    with torch.no_grad():
        full = [reference(torch.tensor([p])).logits[0].float() for p in prompts]
    expected = [f[: len(p) - num_steps] for f, p in zip(full, prompts, strict=True)]
    for step in range(num_steps, 0, -1):
        expected.append(torch.stack([f[len(p) - step] for f, p in zip(full, prompts, strict=True)]))
    assert max(float(f.abs().max()) for f in full) > 4, "logits too flat to compare"
    torch.testing.assert_close(torch.cat(outputs), torch.cat(expected), atol=ATOL, rtol=0)


# --- reading --------------------------------------------------------------------------------


def smollm2_path() -> Path:
    """The default model's GGUF (scripts/setup.sh installs it; missing is a failure)."""
    return default_model_file()


def every_value_type(path: Path) -> dict[str, bytes]:
    """Write a GGUF with every metadata value type, arrays of them, a 64-byte alignment and
    tensors of several types (not a model: for the parser only); return the tensors' bytes."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    for index, (kind, value) in enumerate(
        [
            (gguf.GGUFValueType.UINT8, 200),
            (gguf.GGUFValueType.INT8, -100),
            (gguf.GGUFValueType.UINT16, 60000),
            (gguf.GGUFValueType.INT16, -30000),
            (gguf.GGUFValueType.UINT32, 4_000_000_000),
            (gguf.GGUFValueType.INT32, -2_000_000_000),
            (gguf.GGUFValueType.FLOAT32, 0.1),
            (gguf.GGUFValueType.BOOL, True),
            (gguf.GGUFValueType.STRING, "naïve ✓"),
            (gguf.GGUFValueType.UINT64, 2**63 + 5),
            (gguf.GGUFValueType.INT64, -(2**62)),
            (gguf.GGUFValueType.FLOAT64, 1e-300),
        ]
    ):
        writer.add_key_value(f"test.scalar{index}", value, kind)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.strings", ["a", "", "ü"])
    writer.add_array("test.bools", [True, False])
    rng = np.random.default_rng(3)
    written = {}
    for name, type_name, shape in [
        ("a.weight", "F32", (3, 7)),
        ("b.weight", "Q4_K", (2, 512)),
        ("c.weight", "BF16", (5, 4)),
        ("d.weight", "Q5_0", (1, 64)),
    ]:
        raw = quantize(rng.standard_normal(shape).astype(np.float32), type_name)
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[type_name])
        written[name] = raw.tobytes()
    write_out(writer, path)
    return written


@pytest.mark.parametrize("source", ["write_gguf", "every_value_type", "smollm2"])
def test_parser_agrees_with_the_gguf_package(
    source: str, gguf_path: Callable[[str, str], Path], tmp_path: Path
) -> None:
    written: dict[str, bytes] = {}
    if source == "smollm2":
        path = smollm2_path()
    elif source == "every_value_type":
        path = tmp_path / "values.gguf"
        written = every_value_type(path)
    else:
        path = gguf_path("llama", "Q4_K")
    reader = gguf.GGUFReader(path)
    theirs = {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.")  # the header, not metadata
    }
    with open_gguf(path) as ours:
        assert ours.metadata == theirs
        assert list(ours.tensors) == [t.name for t in reader.tensors]
        for tensor in reader.tensors:
            mine = ours.tensors[tensor.name]
            assert mine.shape == tuple(reversed(tensor.shape.tolist())), tensor.name
            assert mine.type_name == tensor.tensor_type.name, tensor.name
            assert (mine.offset, mine.nbytes) == (tensor.data_offset, tensor.n_bytes)
        for name, data in written.items():
            assert bytes(ours.data(ours.tensors[name])) == data, name


# --- errors ---------------------------------------------------------------------------------


def raw_model(path: Path, arch: str, extra: dict[str, tuple[np.ndarray, Any]]) -> Path:
    """A GGUF of ``arch`` with an embedding and the ``extra`` tensors {name: (data, type)}."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("token_embd.weight", np.ones((8, 32), dtype=np.float32))
    for name, (data, raw_dtype) in extra.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    return write_out(writer, path)


@pytest.mark.parametrize("type_name", ["IQ4_NL", "Q8_1"])
def test_unsupported_tensor_type_is_named(type_name: str, tmp_path: Path) -> None:
    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((4, 256 // block_size * type_size), dtype=np.uint8)
    path = raw_model(tmp_path / "m.gguf", "llama", {"blk.0.attn_q.weight": (raw, qtype)})
    with pytest.raises(ModelLoadError) as error:
        load(path)
    message = str(error.value)
    assert f"tensor type {type_name} (e.g. blk.0.attn_q.weight) is not supported" in message
    assert "supported: " + ", ".join(SUPPORTED_TENSOR_TYPES) in message


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = raw_model(tmp_path / "m.gguf", "gemma2", {})
    with pytest.raises(
        ModelLoadError,
        match=r"GGUF architecture 'gemma2' is not supported; supported: llama, mistral, qwen2, "
        r"qwen3",
    ):
        load(path)


def test_mixture_of_experts_tensor_is_refused(tmp_path: Path) -> None:
    experts = np.zeros((4, 16, 32), dtype=np.float32)  # [experts, rows, columns]
    path = raw_model(tmp_path / "m.gguf", "llama", {"blk.0.ffn_gate_exps.weight": (experts, None)})
    with pytest.raises(
        ModelLoadError,
        match=r"'blk\.0\.ffn_gate_exps\.weight' has no place in a llama model "
        r"\(mixture-of-experts models are not supported\)",
    ):
        load(path)


@pytest.mark.parametrize("cut_in", ["header", "tensor data"])
def test_truncated_file_is_reported(
    cut_in: str, gguf_path: Callable[[str, str], Path], tmp_path: Path
) -> None:
    whole = gguf_path("llama", "Q8_0").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:100] if cut_in == "header" else whole[:-1000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf is truncated.*re-download or re-convert"):
        load(cut)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "is empty, not a GGUF file"), (None, "is not a GGUF file \\(it does not start with")],
)
def test_file_that_is_not_gguf_is_reported(
    content: bytes | None, message: str, model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    path = tmp_path / "model.gguf"  # a safetensors file renamed, or an empty one
    path.write_bytes(
        (model_dir("llama") / "model.safetensors").read_bytes() if content is None else content
    )
    with pytest.raises(ModelLoadError, match=message):
        load(path)


@pytest.fixture(scope="module")
def split_parts(
    model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> list[Path]:
    out = tmp_path_factory.mktemp("split") / "model.gguf"
    first = write_gguf(
        model_dir("llama"), out, tensor_type="Q8_0", tokenizer=False, split_max_tensors=11
    )
    return [first, first.with_name("model-00002-of-00002.gguf")]


def test_split_model_loads_as_one(
    split_parts: list[Path], gguf_path: Callable[[str, str], Path]
) -> None:
    assert split_parts[0].name == "model-00001-of-00002.gguf"
    assert all(part.is_file() for part in split_parts)
    with open_gguf(split_parts[0]) as file:
        assert file.paths == split_parts
        assert {t.file for t in file.tensors.values()} == set(split_parts)
    config, weights = load(split_parts[0])
    whole_config, whole_weights = load(gguf_path("llama", "Q8_0"))
    assert config == whole_config
    assert set(weights) == set(whole_weights)
    for name, weight in whole_weights.items():
        assert torch.equal(weights[name], weight), name


def test_split_model_needs_every_part_and_its_first(
    split_parts: list[Path], tmp_path: Path
) -> None:
    with pytest.raises(
        ModelLoadError,
        match=r"part 2 of a split GGUF; point \[model\] path at the first part, "
        r"model-00001-of-00002\.gguf",
    ):
        load(split_parts[1])
    lonely = tmp_path / split_parts[0].name
    lonely.write_bytes(split_parts[0].read_bytes())
    with pytest.raises(
        ModelLoadError, match=r"split GGUF of 2 parts is missing model-00002-of-00002\.gguf"
    ):
        load(lonely)


# --- the writer's own errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "overrides", "tensor_type", "message"),
    [
        ("llama", {}, "IQ4_NL", "tensor_type 'IQ4_NL' is not supported; supported: F32, F16"),
        (
            "llama",
            {"intermediate_size": 688},
            "Q4_0",
            r"'model\.layers\.0\.mlp\.down_proj\.weight' has rows of 688 values, not a "
            r"multiple of Q4_0's block size 32",
        ),
        (
            "mistral",
            {"sliding_window": 16},
            "F32",
            r"sliding_window 16 < max_position_embeddings 4096: a 'llama' GGUF cannot express",
        ),
    ],
)
def test_writer_refuses_what_it_cannot_write(
    arch: str, overrides: dict[str, Any], tensor_type: str, message: str, tmp_path: Path
) -> None:
    directory = create_model(tmp_path / "model", arch, overrides={**SHAPE, **overrides})
    with pytest.raises(ValueError, match=message):
        write_gguf(directory, tmp_path / "m.gguf", tensor_type=tensor_type, tokenizer=False)
