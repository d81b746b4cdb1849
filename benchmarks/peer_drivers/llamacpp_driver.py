"""llama.cpp's driver (runs in llama-cpp-python's venv): batched greedy decoding, low-level API.

llama-cpp-python's ``Llama`` class generates one sequence at a time, which would understate
llama.cpp; this driver batches across requests as llama.cpp's ``examples/batched`` does: one
``llama_decode`` per step holding the next token of every active sequence, each in its own
sequence id.

Policy (continuous batching, no chunked prefill):

- Up to ``options["n_parallel"]`` (32) requests are active, each in its own sequence. Before
  every decode step, waiting requests (in order) fill the free sequences; each new prompt is
  prefilled by its own ``llama_decode`` (split into ``n_ubatch`` pieces by llama.cpp), which
  yields its first token. The step then decodes one token for every active sequence. A
  finished sequence's KV is removed and its sequence id reused at the next step.
- KV cache in the job's dtype, F32 or BF16 (llama.cpp defaults to F16; the other engines keep
  their KV in the model's dtype), on the GGUF of that dtype; one KV stream
  per sequence (``kv_unified = false``: attention reads only the sequence's own cells), sized
  for the job's longest prompt + output. Flash attention: llama.cpp's ``auto``.
- Prefix caching (jobs with it on, batches with a ``shared_prefix_len``): the shared prefix is
  prefilled once into a spare sequence and kept there across calls (a one-entry prefix cache,
  filled by the warm-up as the other engines' caches are); each request copies it with
  ``llama_memory_seq_cp`` (a buffer copy between streams) and prefills only its own tokens.
- Greedy is the argmax of the step's logits (NumPy; the first maximum on ties, as llama.cpp's
  greedy sampler).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import llama_cpp as llama
import numpy as np
from peer_protocol import Batch, Generate, Job, run_job

GGML_TYPE_BF16 = 30
"""ggml's type id of bfloat16 (llama-cpp-python names F32 and F16 but not it)."""
KV_TYPES = {"float32": (llama.GGML_TYPE_F32, "F32"), "bfloat16": (GGML_TYPE_BF16, "BF16")}
CTX_ALIGN = 256
"""Per-sequence KV sizes are rounded up to this (llama.cpp pads its KV to 256 cells)."""


@dataclasses.dataclass
class Active:
    request: int
    position: int
    """Position of the next token to decode: the tokens before it are in the KV cache."""
    tokens: list[int]
    wanted: int


class Runner:
    """One llama.cpp context and the continuous-batching loop over it."""

    def __init__(self, job: Job) -> None:
        self.n_parallel = int(job.options.get("n_parallel", 32))
        self.prefix_reuse = job.prefix_caching and hasattr(llama, "llama_memory_seq_cp")
        self.prefix_seq = self.n_parallel  # the spare sequence holding the shared prefix
        self.cached_prefix: tuple[int, ...] | None = None
        per_seq = -(-job.max_seq_len // CTX_ALIGN) * CTX_ALIGN
        n_seq_max = self.n_parallel + (1 if self.prefix_reuse else 0)
        max_prompt = max(
            len(prompt)
            for workload in job.workloads
            for batch in [workload.warmup, *workload.runs]
            for prompt in batch.prompts
        )
        self.n_batch = max(max_prompt, self.n_parallel, 512)

        llama.llama_backend_init()
        model_params = llama.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = llama.llama_model_load_from_file(job.model["gguf"].encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {job.model['gguf']}")
        self.n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        params = llama.llama_context_default_params()
        params.n_ctx = per_seq * n_seq_max
        params.n_batch = self.n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = job.threads
        params.n_threads_batch = job.threads
        kv_type, kv_name = KV_TYPES[job.dtype]
        params.type_k = kv_type
        params.type_v = kv_type
        params.kv_unified = bool(job.options.get("kv_unified", False))
        params.no_perf = True
        self.ctx = llama.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = llama.llama_get_memory(self.ctx)
        self.n_ctx_seq = llama.llama_n_ctx_seq(self.ctx)
        if self.n_ctx_seq < job.max_seq_len:
            raise RuntimeError(
                f"llama.cpp gave each sequence {self.n_ctx_seq} KV cells, the job needs "
                f"{job.max_seq_len}"
            )
        self.batch = llama.llama_batch_init(self.n_batch, 0, 1)
        self.facts = {
            "llama_cpp_python": llama.__version__,
            "n_parallel": self.n_parallel,
            "n_batch": self.n_batch,
            "n_ubatch": params.n_ubatch,
            "n_ctx_seq": self.n_ctx_seq,
            "kv_unified": bool(params.kv_unified),
            "kv_type": kv_name,
            "prefix_reuse": "llama_memory_seq_cp" if self.prefix_reuse else "none",
            "system_info": llama.llama_print_system_info().decode(errors="replace").strip(),
        }

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode (token, position, sequence, wants logits) entries in one llama_decode."""
        batch = self.batch
        for index, (token, position, seq, logits) in enumerate(entries):
            batch.token[index] = token
            batch.pos[index] = position
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = seq
            batch.logits[index] = logits
        batch.n_tokens = len(entries)
        code = llama.llama_decode(self.ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for {len(entries)} tokens")

    def _argmax(self, index: int) -> int:
        logits = llama.llama_get_logits_ith(self.ctx, index)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def _prefill(self, tokens: list[int], start: int, seq: int) -> int:
        """Put ``tokens`` at positions ``start``... of ``seq``; the last one's greedy successor."""
        chunk: list[int] = []
        for chunk_start in range(0, len(tokens), self.n_batch):
            chunk = tokens[chunk_start : chunk_start + self.n_batch]
            last = chunk_start + len(chunk) == len(tokens)
            self._decode(
                [
                    (token, start + chunk_start + i, seq, last and i == len(chunk) - 1)
                    for i, token in enumerate(chunk)
                ]
            )
        return self._argmax(len(chunk) - 1)

    def _admit(self, prompt: list[int], seq: int, shared_prefix_len: int) -> int:
        start = 0
        if self.prefix_reuse and shared_prefix_len:
            start = min(shared_prefix_len, len(prompt) - 1)  # the last token must be decoded
            prefix = tuple(prompt[:start])
            if prefix != self.cached_prefix:
                llama.llama_memory_seq_rm(self.memory, self.prefix_seq, -1, -1)
                self._prefill(list(prefix), 0, self.prefix_seq)
                self.cached_prefix = prefix
            llama.llama_memory_seq_cp(self.memory, self.prefix_seq, seq, -1, -1)
        return self._prefill(prompt[start:], start, seq)

    def generate(self, batch: Batch) -> list[list[int]]:
        outputs: list[list[int]] = [[] for _ in batch.prompts]
        waiting = collections.deque(range(len(batch.prompts)))
        free = list(range(self.n_parallel - 1, -1, -1))
        active: dict[int, Active] = {}
        # Each iteration admits or decodes at least one token, so this bounds the loop.
        for _ in range(batch.num_output_tokens + len(batch.prompts) + 1):
            while waiting and free:
                request, seq = waiting.popleft(), free.pop()
                prompt = batch.prompts[request]
                first = self._admit(prompt, seq, batch.shared_prefix_len)
                active[seq] = Active(request, len(prompt), [first], batch.output_lens[request])
            for seq in [s for s, a in active.items() if len(a.tokens) >= a.wanted]:
                self._finish(active.pop(seq), seq, outputs, free)
            if not active:
                if waiting:
                    continue
                return outputs
            seqs = list(active)
            self._decode([(active[s].tokens[-1], active[s].position, s, True) for s in seqs])
            for index, seq in enumerate(seqs):
                state = active[seq]
                state.tokens.append(self._argmax(index))
                state.position += 1
        raise RuntimeError("the batching loop did not finish within its bound")

    def _finish(self, state: Active, seq: int, outputs: list[list[int]], free: list[int]) -> None:
        outputs[state.request] = state.tokens
        llama.llama_memory_seq_rm(self.memory, seq, -1, -1)
        free.append(seq)


def load(job: Job) -> tuple[Generate, dict[str, Any]]:
    runner = Runner(job)
    return runner.generate, runner.facts


if __name__ == "__main__":
    run_job(load)
