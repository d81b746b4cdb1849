"""Parity on the real default model: Brigade on SmolLM2-135M-Instruct's Q4_1 GGUF against
transformers' own GGUF loading (``from_pretrained(..., gguf_file=...)``, dequantized to fp32).

Both dequantize the same bytes, so the weights are identical and any difference comes from
the forward pass. The prompts hold no digits: transformers' GGUF tokenizer converter ignores
``tokenizer.ggml.pre`` and does not split numbers into single digits as llama.cpp's "smollm"
pre-tokenizer (and Brigade) do, so text with digits tokenizes differently there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from brigade import LLM, SamplingParams
from brigade.models.checkpoint import default_model_file
from brigade.models.tokenizer_loading import render_chat_prompt
from brigade.testing.parity import assert_greedy_match

LOGPROB_ATOL = 2e-4
"""fp32: Brigade's and transformers' log probabilities of the same tokens after the same
prefix (the chosen token and the top 5, 24 steps, 8 prompts). Measured: at most 2.2e-5 (30
layers of float32 round-off); the bound leaves a 10x margin."""
TIE_ATOL = 1e-3
"""A greedy divergence counts as a tie only when the reference's two logits are this close."""
MAX_TOKENS = 24
TOP = 5

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Name three fruits that are red."}],
    [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi! How can I help you today?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
    ],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "Give me a tip for writing clean Python code."}],
    [{"role": "user", "content": "Explain what a black hole is, simply."}],
]


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """transformers' model and tokenizer, both read from the same GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = default_model_file()
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32
    )
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The default model, exactly as `brigade serve` would load it, in float32."""
    return LLM(overrides=["model.dtype=float32", "kv.num_pages=512", "kv.page_size=16"])


def test_chat_template_ids_equal_transformers(llm: LLM, reference: tuple[Any, Any]) -> None:
    _, hf_tokenizer = reference
    for chat in CHATS:
        ours = render_chat_prompt(llm.tokenizer, chat)
        theirs = hf_tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ours == list(theirs), chat


def test_greedy_tokens_and_logprobs_match_transformers(
    llm: LLM, reference: tuple[Any, Any]
) -> None:
    model, _ = reference
    prompts = [render_chat_prompt(llm.tokenizer, chat) for chat in CHATS]
    # One mixed batch: prompts of different lengths prefill together, then decode together.
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    results = llm.generate(prompts, params)
    worst, compared = 0.0, 0
    for prompt, result in zip(prompts, results, strict=True):
        output = result.outputs[0]
        ids = torch.tensor([prompt + output.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [MAX_TOKENS, vocab]
        reference_logprobs = torch.log_softmax(logits, dim=-1)

        def score(step: int, token: int, table: torch.Tensor = logits) -> float:
            return float(table[step, token])

        greedy = logits.argmax(dim=-1).tolist()
        matched = assert_greedy_match(
            output.token_ids, greedy, score, atol=TIE_ATOL, label=repr(result.prompt)
        )
        assert output.logprobs is not None
        compared += matched
        for step in range(matched):
            entry = output.logprobs[step]
            assert entry is not None
            for token, logprob in ((entry.token_id, entry.logprob), *entry.top):
                worst = max(worst, abs(logprob - float(reference_logprobs[step, token])))
    assert worst <= LOGPROB_ATOL, f"log probabilities differ by up to {worst:.2e}"
    # A real model has few near-ties: all but one stream must match to the end.
    assert compared >= (len(CHATS) - 1) * MAX_TOKENS, f"only {compared} tokens compared"


def test_the_default_model_answers_with_a_real_sentence(llm: LLM) -> None:
    prompt = render_chat_prompt(
        llm.tokenizer, [{"role": "user", "content": "What is the capital of France?"}]
    )
    result = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))[0].outputs[0]
    assert "Paris" in result.text, result.text
    assert result.finish_reason == "stop", "an instruct model ends its answer with <|im_end|>"


def test_embeddings_match_transformers_hidden_states(llm: LLM, reference: tuple[Any, Any]) -> None:
    from brigade.interfaces import PoolingParams

    model, _ = reference
    texts = [
        "The capital of France is Paris.",
        "Paris is the capital city of France.",
        "Octopuses have three hearts and blue blood.",
    ]
    prompts = [list(llm.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    for pooling in (PoolingParams(), PoolingParams(mode="mean")):
        ours = torch.tensor([o.embedding for o in llm.embed(prompts, pooling)])
        expected = []
        with torch.no_grad():
            for prompt in prompts:
                states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
                final = states[-1][0].float()
                vector = final[-1] if pooling.mode == "last" else final.mean(dim=0)
                expected.append(torch.nn.functional.normalize(vector, dim=0))
        theirs = torch.stack(expected)
        assert ours.shape == theirs.shape == (3, model.config.hidden_size)
        gap = float((ours - theirs).abs().max())
        assert gap < 1e-4, f"{pooling.mode} pooling differs by {gap:.2e}"
        # Real semantics: the paraphrase is nearer than the unrelated sentence.
        similarity = ours @ ours.T
        assert similarity[0, 1] > similarity[0, 2], (pooling.mode, similarity.tolist())
