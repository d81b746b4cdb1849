"""A 70B model for the simulated executor, shared by the simulator, bench and engine tests:
Llama-3-70B's config.json and the settings that run it on four simulated H100s."""

from __future__ import annotations

from pathlib import Path

LLAMA_3_70B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "eos_token_id": 128001,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
}


def settings(model_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        "model.max_model_len=4096",
        "executor.gpu=H100",
        "executor.num_gpus=4",
        "kv.max_memory_gib=100",
        *extra,
    ]
