"""benchmarks/peers.py's setup: the checkpoint every engine reads (built once per model and
dtype), the workloads, and what an engine is."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DRIVERS = Path(__file__).resolve().parent / "peer_drivers"
ENGINES = ("brigade", "transformers", "vllm", "llamacpp")
WORKLOADS = ("uniform", "mixed", "batch1", "shared-prefix")
EXTRA_WORKLOADS = ("long-prefix", "batch1-long")
"""Run only when named in ``--workloads``."""
PREFIX_WORKLOADS = ("shared-prefix", "long-prefix")
"""Run with prefix caching on."""
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
LOG_TAIL_LINES = 25
JOB_GROUPS = {"plain": "prefix caching off", "prefix": "prefix caching on"}
"""Each engine runs in two jobs, keyed so in the facts."""
NOISY_SHARE = 0.05
"""A run during which other processes used more of the CPU than this is marked noisy."""


# --- checkpoints -----------------------------------------------------------------------------


GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}
"""``--dtype`` -> the GGUF tensor type llama.cpp reads."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    name: str
    hf_dir: Path
    brigade_path: str
    """What Brigade's ``model.path`` gets: ``default`` (the GGUF) or the HF folder."""
    config: dict[str, Any]

    def describe(self) -> str:
        c = self.config
        return (
            f"{self.name}: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
            f"heads {c['num_attention_heads']}/{c.get('num_key_value_heads')}, "
            f"vocab {c['vocab_size']}"
        )

    def gguf(self, dtype: str) -> Path:
        """The GGUF of the weights in ``dtype`` (written from the HF folder on first use)."""
        tensor_type = GGUF_TYPES[dtype]
        path = self.hf_dir.parent / f"{self.name}-{tensor_type.lower()}.gguf"
        if not path.exists():
            from brigade.testing.gguf_export import write_gguf

            partial = path.with_name(path.name + ".partial")
            write_gguf(self.hf_dir, partial, tensor_type=tensor_type)
            partial.rename(path)
        return path

    def as_job(self, dtype: str) -> dict[str, Any]:
        return {
            "hf_dir": str(self.hf_dir),
            "gguf": str(self.gguf(dtype)),
            "brigade_path": self.brigade_path,
            "vocab_size": self.config["vocab_size"],
        }


def cache_root() -> Path:
    env = os.environ.get("BRIGADE_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "brigade"
    return root / "peers"


def prepare_checkpoint(name: str) -> Checkpoint:
    """The model's HF folder and F32 GGUF, built on first use (in a temporary folder, renamed)."""
    root = cache_root() / name
    done = root / ".complete"
    if not done.exists():
        print(f"building the {name} checkpoint under {root} (once) ...", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
        partial = root.with_name(root.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        _write_hf_folder(name, partial / "hf")
        (partial / ".complete").touch()
        partial.rename(root)
    config = json.loads((root / "hf" / "config.json").read_text())
    brigade_path = "default" if name == "smollm2" else str(root / "hf")
    return Checkpoint(name, root / "hf", brigade_path, config)


def _write_hf_folder(name: str, out: Path) -> None:
    if name != "smollm2":
        from brigade.models.create import create_model

        create_model(out, "llama", name)
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from brigade.models.checkpoint import default_model_file

    gguf = default_model_file()
    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers refuses to save a GGUF-loaded model until it forgets the quantization;
    # the weights are already dequantized to fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


# --- workloads -------------------------------------------------------------------------------


def _scaled(value: int, scale: float, floor: int = 2) -> int:
    return max(floor, round(value * scale))


def _ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(10, vocab_size) for _ in range(count)]


def _batch(
    prompt_lens: list[int],
    output_lens: list[int],
    rng: random.Random,
    vocab_size: int,
    prefix: list[int] | None = None,
) -> dict[str, Any]:
    head = prefix or []
    return {
        "prompts": [head + _ids(rng, n, vocab_size) for n in prompt_lens],
        "output_lens": list(output_lens),
        "shared_prefix_len": len(head),
    }


def make_workload(
    name: str, vocab_size: int, seed: int, scale: float, repeats: int | None, check: int
) -> dict[str, Any]:
    """A workload as the drivers' protocol takes it: a warm-up batch and timed runs."""
    shape_rng = random.Random(f"{seed}-{name}-shape")
    prefix: list[int] | None = None
    if name == "uniform":
        count = _scaled(32, scale, 1)
        prompt_lens, output_lens = [_scaled(128, scale)] * count, [_scaled(128, scale)] * count
        warmup_count, default_repeats, kind = count, 3, "throughput"
    elif name == "mixed":
        count = _scaled(128, scale, 1)
        prompt_lens = [_scaled(shape_rng.randint(16, 512), scale) for _ in range(count)]
        output_lens = [_scaled(shape_rng.randint(16, 256), scale) for _ in range(count)]
        warmup_count, default_repeats, kind = max(1, count // 8), 1, "throughput"
    elif name in ("batch1", "batch1-long"):  # a short prompt, or a long chat history
        prompt_len = 128 if name == "batch1" else 2048
        count, prompt_lens, output_lens = 1, [_scaled(prompt_len, scale)], [_scaled(256, scale)]
        warmup_count, default_repeats, kind = 1, 3, "latency"
    elif name in PREFIX_WORKLOADS:  # a system prompt of 384 tokens, or a long one of 1536
        count = _scaled(32, scale, 1)
        prefix = _ids(
            shape_rng, _scaled(384 if name == "shared-prefix" else 1536, scale), vocab_size
        )
        prompt_lens, output_lens = [_scaled(32, scale)] * count, [_scaled(64, scale)] * count
        warmup_count, default_repeats, kind = count, 3, "throughput"
    else:
        choices = ", ".join(WORKLOADS + EXTRA_WORKLOADS)
        raise SystemExit(f"unknown workload {name!r}; choose from {choices}")
    num_runs = repeats or default_repeats

    def run(index: int, size: int) -> dict[str, Any]:
        rng = random.Random(f"{seed}-{name}-run{index}")
        return _batch(prompt_lens[:size], output_lens[:size], rng, vocab_size, prefix)

    step = max(1, count // check) if check else count + 1
    return {
        "name": name,
        "kind": kind,
        "warmup": run(0, warmup_count),
        "runs": [run(i, count) for i in range(1, num_runs + 1)],
        "sample": list(range(0, count, step))[:check],
    }


def describe_workload(workload: dict[str, Any], prefix_caching: bool) -> str:
    first = workload["runs"][0]
    lens = [len(p) for p in first["prompts"]]
    outs = first["output_lens"]

    def span(values: list[int]) -> str:
        low, high = min(values), max(values)
        return str(low) if low == high else f"{low}-{high}"

    noun = "request" if len(lens) == 1 else "requests"
    text = f"{len(lens)} {noun}, prompts of {span(lens)} tokens"
    if first["shared_prefix_len"]:
        text += f" (a shared prefix of {first['shared_prefix_len']})"
    text += f" -> {span(outs)} new tokens ({sum(outs)} in all)"
    text += f"; prefix caching {'on' if prefix_caching else 'off'}"
    runs = len(workload["runs"])
    return text + f"; {'median of ' + str(runs) + ' runs' if runs > 1 else 'one run'}"


# --- engines ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Engine:
    name: str
    label: str
    python: Path
    driver: str
    env: dict[str, str]
    missing: str = ""
    """Why it cannot run here ('' when it can)."""
