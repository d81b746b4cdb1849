"""A GGUF written from a created model serves exactly like the Hugging Face original: the same
token ids, chat prompts, EOS ids and greedy text, for both tokenizer kinds; quantized files
run end to end; loading shows progress on a terminal only."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

from brigade import LLM, SamplingParams
from brigade.models.checkpoint import open_checkpoint
from brigade.models.create import create_model
from brigade.models.tokenizer_loading import render_chat_prompt
from brigade.testing.gguf_export import write_gguf

SETTINGS = ["kv.page_size=8", "kv.num_pages=64", "model.dtype=float32"]
SHAPE = {"num_hidden_layers": 2, "intermediate_size": 512}
PROMPTS = ["The kitchen opens at", "Café au lait, s'il vous plaît — merci!", "  spaced\tout\n"]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is on the menu today?"},
]


@pytest.fixture(scope="module", params=["bpe", "spm"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(HF directory, the same model as an F32 GGUF) for one tokenizer kind."""
    root = tmp_path_factory.mktemp(request.param)
    directory = create_model(root / "hf", "llama", overrides=SHAPE, tokenizer=request.param)
    return directory, write_gguf(directory, root / "model.gguf", tensor_type="F32")


def test_the_gguf_serves_like_its_original(pair: tuple[Path, Path]) -> None:
    directory, gguf = pair
    original = LLM(overrides=[f"model.path={directory}", *SETTINGS])
    converted = LLM(overrides=[f"model.path={gguf}", *SETTINGS])
    assert converted.engine.checkpoint.format == "gguf"
    for text in PROMPTS:
        assert converted.tokenizer.encode(text) == original.tokenizer.encode(text), text
    chat = render_chat_prompt(converted.tokenizer, CHAT)
    assert chat == render_chat_prompt(original.tokenizer, CHAT)
    assert converted.engine.eos_token_ids == original.engine.eos_token_ids
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0] for o in converted.generate([*PROMPTS, chat], params)]
    theirs = [o.outputs[0] for o in original.generate([*PROMPTS, chat], params)]
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert [o.text for o in ours] == [o.text for o in theirs]
    assert len({t for o in ours for t in o.token_ids}) > 8, "a degenerate continuation"


def test_a_quantized_gguf_runs_end_to_end(pair: tuple[Path, Path], tmp_path: Path) -> None:
    directory, _ = pair
    quantized = write_gguf(directory, tmp_path / "q4k.gguf", tensor_type="Q4_K")
    llm = LLM(overrides=[f"model.path={quantized}", *SETTINGS])
    assert "Q4_K" in llm.engine.checkpoint.describe()
    outputs = llm.chat(CHAT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(outputs[0].outputs[0].token_ids) == 8


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_loading_shows_progress_on_a_terminal_only(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, gguf = pair
    for path, label in ((gguf, "dequantizing F32"), (directory, "loading hf")):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        list(open_checkpoint(str(path)).weights(torch.float32, "cpu"))
        assert label in terminal.getvalue(), terminal.getvalue()
        piped = io.StringIO()
        monkeypatch.setattr(sys, "stderr", piped)
        list(open_checkpoint(str(path)).weights(torch.float32, "cpu"))
        assert piped.getvalue() == ""
