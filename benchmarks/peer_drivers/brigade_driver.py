"""Brigade's driver (runs in the repository's .venv): ``LLM.generate`` on token-id prompts.

The job's dtype (KV cache included), greedy, EOS ignored; prefix caching as the job says;
``options["settings"]`` are ``station.key=value`` overrides passed through from ``peers.py
--set``.
"""

from __future__ import annotations

from typing import Any

from peer_protocol import Batch, Generate, Job, run_job


def load(job: Job) -> tuple[Generate, dict[str, Any]]:
    import torch

    from brigade import LLM, SamplingParams
    from brigade.version import installed_version

    torch.set_num_threads(job.threads)
    overrides = [
        f"model.path={job.model['brigade_path']}",
        f"model.dtype={job.dtype}",
        f"kv.enable_prefix_caching={'true' if job.prefix_caching else 'false'}",
        *job.options.get("settings", []),
    ]
    llm = LLM(overrides=overrides)

    def generate(batch: Batch) -> list[list[int]]:
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            for n in batch.output_lens
        ]
        outputs = llm.generate(batch.prompts, params, use_tqdm=False)
        stats = llm.engine.kv.stats()
        facts["prefix_cache_hits"] = (
            f"{stats.prefix_cache_hits}/{stats.prefix_cache_queries} looked-up tokens"
        )
        return [output.outputs[0].token_ids for output in outputs]

    facts: dict[str, Any] = {
        "brigade": installed_version(),
        "torch": torch.__version__,
        "overrides": overrides,
    }
    return generate, facts


if __name__ == "__main__":
    run_job(load)
