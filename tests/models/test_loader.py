"""Loading a model directory: every user mistake gets a clear error; dtypes and shards work."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from brigade.errors import ModelLoadError
from brigade.interfaces import ExecutorParams, NoOptions
from brigade.model_input import SeqChunk, build_model_input
from brigade.models.checkpoint import open_checkpoint
from brigade.models.loader import iter_safetensors, read_hf_config, resolve_dtype_name
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions
from brigade.plugins.models.architectures import ARCHITECTURES

PROMPT = [3, 17, 99, 4, 250, 8, 61]


def load(directory: Path, dtype: str = "float32", **params: Any) -> TorchExecutor:
    settings: dict[str, Any] = {"page_size": 4, "kv_cache_dtype": "auto", "max_model_len": 0}
    executor = TorchExecutor(
        ExecutorParams(
            model_path=str(directory),
            dtype=dtype,
            attention=SdpaBackend(NoOptions()),
            **{**settings, **params},
            checkpoint=open_checkpoint(str(directory)),
        ),
        TorchExecutorOptions(device="cpu"),
    )
    executor.initialize_kv_cache(8)
    return executor


def prompt_logits(executor: TorchExecutor) -> torch.Tensor:
    batch = build_model_input([SeqChunk(PROMPT, 0, [5, 2], want_logits="all")], page_size=4)
    return executor.execute(batch)


@pytest.fixture
def llama_dir(hf_model_dir: Callable[..., tuple[Any, Path]]) -> Path:
    return hf_model_dir("llama")[1]


def edit_config(directory: Path, **changes: Any) -> None:
    file = directory / "config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def edit_weights(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = directory / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_hf_config(tmp_path / "nowhere")


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json not found"):
        read_hf_config(tmp_path)


def test_corrupt_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON"):
        read_hf_config(tmp_path)


def test_config_without_architectures(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="no 'architectures' list"):
        read_hf_config(tmp_path)


def test_unsupported_architecture_lists_supported_names(llama_dir: Path) -> None:
    edit_config(llama_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as error:
        load(llama_dir)
    for name in ARCHITECTURES:
        assert name in str(error.value)


def test_missing_weights(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors in"):
        load(llama_dir)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: b"\x00garbage" + data[9:], id="corrupt-header"),
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
    ],
)
def test_corrupt_safetensors_names_the_file(
    llama_dir: Path, damage: Callable[[bytes], bytes]
) -> None:
    file = llama_dir / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load(llama_dir)


def test_missing_tensor_is_named(llama_dir: Path) -> None:
    edit_weights(llama_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load(llama_dir)


def test_unexpected_tensor_is_named(llama_dir: Path) -> None:
    edit_weights(llama_dir, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(2)}))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.extra\.weight"):
        load(llama_dir)


def test_wrong_shape_is_named(llama_dir: Path) -> None:
    edit_config(llama_dir, intermediate_size=96)
    pattern = r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape .*128.*implies .*96"
    with pytest.raises(ModelLoadError, match=pattern):
        load(llama_dir)


def test_sharded_checkpoint_loads(
    hf_model_dir: Callable[..., tuple[Any, Path]], tmp_path: Path
) -> None:
    model, single = hf_model_dir("llama")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    torch.testing.assert_close(prompt_logits(load(sharded)), prompt_logits(load(single)))
    next(iter(sorted(sharded.glob("model-*.safetensors")))).unlink()
    with pytest.raises(ModelLoadError, match="lists shard"):
        load(sharded)


def test_bfloat16_checkpoint_iterates_as_float32(
    hf_model_dir: Callable[..., tuple[Any, Path]],
) -> None:
    _, directory = hf_model_dir("llama", storage_dtype=torch.bfloat16)
    dtypes = {t.dtype for _, t in iter_safetensors(directory, torch.float32, "cpu")}
    assert dtypes == {torch.float32}


def test_float32_and_bfloat16_models(llama_dir: Path) -> None:
    full = load(llama_dir, dtype="float32")
    half = load(llama_dir, dtype="bfloat16")
    assert isinstance(half.model, torch.nn.Module)
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    full_logits, half_logits = prompt_logits(full), prompt_logits(half)
    assert half_logits.dtype == torch.float32
    # bf16 is compared by tolerance only (logits up to ~7, bf16 keeps ~3 significant digits)
    torch.testing.assert_close(half_logits, full_logits, atol=0.25, rtol=0)


def test_resolve_dtype_name() -> None:
    assert resolve_dtype_name("auto", {"dtype": "bfloat16"}) == "bfloat16"
    assert resolve_dtype_name("auto", {"torch_dtype": "torch.float16"}) == "float16"
    assert resolve_dtype_name("auto", {}) == "float32"
    assert resolve_dtype_name("bfloat16", {"dtype": "float32"}) == "bfloat16"
    with pytest.raises(ValueError, match="allowed: auto, float32, bfloat16, float16"):
        resolve_dtype_name("fp8", {})
    with pytest.raises(ModelLoadError, match="torch_dtype='int8'"):
        resolve_dtype_name("auto", {"torch_dtype": "int8"})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_scaling: rope_type 'dynamic'",
        ),
        ({"rope_scaling": {"type": "longrope"}}, "rope_type 'longrope' is not supported"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
            "rope_parameters: rope_type",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported; allowed: silu"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ],
)
def test_config_refusals_name_the_key(changes: dict[str, Any], message: str) -> None:
    config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 256,
        **changes,
    }
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ARCHITECTURES["LlamaForCausalLM"]().validate_config(config)


def test_qwen_layer_types_refusal() -> None:
    config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 256,
        "use_sliding_window": True,
        "sliding_window": 8,
        "layer_types": ["full_attention", "chunked_attention"],
    }
    with pytest.raises(ValueError, match="layer_types holds chunked_attention; allowed"):
        ARCHITECTURES["Qwen2ForCausalLM"]().validate_config(config)


def test_executor_misuse_is_explained(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="allowed: auto, cpu, cuda, cuda:N"):
        TorchExecutor(
            ExecutorParams(
                str(llama_dir),
                "float32",
                SdpaBackend(NoOptions()),
                4,
                "auto",
                0,
                checkpoint=open_checkpoint(str(llama_dir)),
            ),
            TorchExecutorOptions(device="tpu"),
        )
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 128"):
        load(llama_dir, max_model_len=4096)
    # Core resolves [model] dtype = "auto" before it builds the params.
    with pytest.raises(ValueError, match="dtype 'auto' is not supported; allowed: float32,"):
        load(llama_dir, dtype="auto")
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'int8' .* allowed: auto, float32,"):
        load(llama_dir, kv_cache_dtype="int8")
    executor = load(llama_dir)
    with pytest.raises(RuntimeError, match="already called"):
        executor.initialize_kv_cache(8)
    with pytest.raises(ValueError, match="page_size 8 differs"):
        executor.execute(build_model_input([SeqChunk([1, 2], 0, [0])], page_size=8))


def test_kv_cache_spec(llama_dir: Path) -> None:
    spec = load(llama_dir, dtype="bfloat16").kv_cache_spec()
    # 2 layers x (K and V) x 4 tokens x 2 KV heads x head_dim 16 x 2 bytes
    assert spec.bytes_per_page == 2 * 2 * 4 * 2 * 16 * 2
    assert (spec.num_layers, spec.max_model_len, spec.vocab_size) == (2, 128, 256)
    assert spec.available_bytes > 0
