"""transformers' driver (runs in the repository's .venv): ``generate`` on static batches.

As ``benchmarks/offline_throughput.py`` runs it: requests in order, ``options["batch_size"]``
(32) at a time, left-padded, each batch until its longest output (``min_new_tokens`` keeps EOS
from ending it early); only the tokens each request asked for are returned and counted. No
prefix caching.
"""

from __future__ import annotations

from typing import Any

from peer_protocol import Batch, Generate, Job, run_job


def load(job: Job) -> tuple[Generate, dict[str, Any]]:
    import torch
    import transformers

    torch.set_num_threads(job.threads)
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        job.model["hf_dir"], dtype=getattr(torch, job.dtype)
    ).eval()
    pad = model.generation_config.pad_token_id or 0
    batch_size = int(job.options.get("batch_size", 32))

    def generate_static(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad,
        )
        return out[:, width:].tolist()

    def generate(batch: Batch) -> list[list[int]]:
        results: list[list[int]] = []
        with torch.inference_mode():
            for start in range(0, len(batch.prompts), batch_size):
                lens = batch.output_lens[start : start + batch_size]
                rows = generate_static(batch.prompts[start : start + batch_size], max(lens))
                results.extend(row[:n] for row, n in zip(rows, lens, strict=True))
        return results

    facts = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "batch_size": batch_size,
    }
    return generate, facts


if __name__ == "__main__":
    run_job(load)
