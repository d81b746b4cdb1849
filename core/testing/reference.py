"""A minimal greedy decoding loop over any executor: the reference the engine must match.

No scheduler, no prefix cache: every sequence owns a fixed run of pages sized for its whole
generation, all prompts prefill in one step and every later step decodes every live sequence.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from brigade.interfaces import Executor
from brigade.model_input import SeqChunk, build_model_input

__all__ = ["greedy_generate"]


def greedy_generate(
    executor: Executor,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    page_size: int,
    eos_token_ids: Collection[int] = (),
    first_page: int = 0,
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (each stops early at an EOS id, which it keeps)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate needs at least one prompt, and no empty prompt")
    tables: list[list[int]] = []
    next_page = first_page
    for prompt in prompts:
        num_pages = -(-(len(prompt) + max_new_tokens) // page_size)
        tables.append(list(range(next_page, next_page + num_pages)))
        next_page += num_pages
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = [SeqChunk(list(p), 0, tables[i]) for i, p in enumerate(prompts)]
    live = list(range(len(prompts)))
    while live:
        logits = executor.execute(build_model_input(chunks, page_size))
        next_ids: list[int] = torch.argmax(logits, dim=-1).tolist()
        still_live: list[int] = []
        for index, token in zip(live, next_ids, strict=True):
            outputs[index].append(token)
            if len(outputs[index]) < max_new_tokens and token not in eos_token_ids:
                still_live.append(index)
        live = still_live
        chunks = [
            SeqChunk([outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, tables[i])
            for i in live
        ]
    return outputs
