"""GGUF tokenizers rebuilt from ``tokenizer.ggml.*`` metadata tokenize as llama.cpp does.

SmolLM2's GGUF is checked against transformers' own GGUF tokenizer; created models of both
kinds (byte-level BPE and SentencePiece) are written into a GGUF and read back, and must encode
and decode exactly like the ``tokenizer.json`` they came from. The SentencePiece rebuild is also
checked against a Python transcription of llama.cpp's SPM algorithm.
"""

from __future__ import annotations

import copy
import heapq
import json
import logging
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Tokenizer

from brigade.errors import ModelLoadError
from brigade.models.checkpoint import default_model_file
from brigade.models.create import create_model
from brigade.models.gguf import GGUFFile, open_gguf
from brigade.models.gguf_tokenizer import (
    PRE_TOKENIZERS,
    gguf_eos_token_ids,
    gguf_tokenizer_spec,
)
from brigade.models.tokenizer import CORPUS_PATH
from brigade.models.tokenizer_loading import build_tokenizer, render_chat_prompt
from brigade.testing.gguf_tokenizer_export import add_tokenizer_metadata

# No digits here: transformers' GGUF converter ignores tokenizer.ggml.pre for "smollm" and
# keeps GPT-2's regex, which does not split numbers into single digits as llama.cpp does.
SMOLLM2_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple     spaces inside",
    "tabs\tand\t\tmore tabs",
    "line one\nline two\n\nline four\n",
    "\r\nwindows line endings\r\n",
    "mixed \n \t whitespace \n\n  ",
    "<|im_start|>user\nHi!<|im_end|>\n",
    "text<|endoftext|>more text",
    "<|im_end|><|im_start|>",
    "<repo_name>brigade<file_sep>main.py",
    "café, naïve, Ångström, Straße",
    "Привет, мир",
    "日本語のテキストと中文",
    "emoji 🎉🚀👍🏽 and a flag 🇫🇷",
    "I'm sure they can't, won't, they'll, we'd, you've",
    "def square(x):\n    return x * x\n",
    '{"key": ["value", null]}',
    "",
    " ",
    "\n",
]

CONVERSATIONS: list[tuple[list[dict[str, str]], bool]] = [
    ([{"role": "user", "content": "What is the capital of France?"}], True),
    (
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Colour of the sky?"},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And grass? 🌱\nBe brief."},
        ],
        True,
    ),
    (
        [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "  hi  there\n"},
        ],
        False,
    ),
]

# Texts for created models: the corpus lines plus what exercises the edges of each kind.
EDGE_TEXTS = [
    "",
    " ",
    "  leading spaces",
    "trailing spaces  ",
    "inner   spaces",
    "\ttab\t\ttabs",
    "new\nlines\n\n",
    "\n",
    " \n \t ",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "before<|im_end|>after",
    "<|endoftext|><|begin_of_text|><|pad|>",
    "<s>inside</s> text <unk> and more",
    "accents: café naïve Ångström Straße",
    "CJK 猫 狗 日本語 한국어",
    "emoji 🦙 🎉 👍🏽",
    "numbers 2024 and 3.14159",
]
CORPUS_LINES = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
CREATED_TEXTS = [*CORPUS_LINES, *EDGE_TEXTS, "\n".join(CORPUS_LINES[:40])]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    """The default model's GGUF (scripts/setup.sh installs it; missing is a failure)."""
    return default_model_file()


@pytest.fixture(scope="module")
def smollm2_file(smollm2_path: Path) -> GGUFFile:
    return open_gguf(smollm2_path)


@pytest.fixture(scope="module")
def smollm2(smollm2_file: GGUFFile) -> Any:
    """Brigade's SmolLM2 tokenizer, from the GGUF's metadata."""
    return build_tokenizer(gguf_tokenizer_spec(smollm2_file))


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2_path: Path) -> Any:
    """transformers' own tokenizer for the same GGUF."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name
    )


@pytest.mark.parametrize("text", SMOLLM2_TEXTS)
def test_smollm2_encodes_like_transformers(
    smollm2: Any, smollm2_transformers: Any, text: str
) -> None:
    assert smollm2.encode(text) == smollm2_transformers.encode(text)
    assert smollm2.encode(text, add_special_tokens=False) == smollm2_transformers.encode(
        text, add_special_tokens=False
    )


@pytest.mark.parametrize(("messages", "add_generation_prompt"), CONVERSATIONS)
def test_smollm2_chat_template_tokenizes_like_transformers(
    smollm2: Any,
    smollm2_transformers: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    reference_text = smollm2_transformers.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    reference = smollm2_transformers.encode(reference_text, add_special_tokens=False)
    ids = render_chat_prompt(smollm2, messages, add_generation_prompt=add_generation_prompt)
    assert ids == reference
    assert smollm2.decode(ids) == reference_text


@pytest.mark.parametrize("text", [*SMOLLM2_TEXTS, "pi is 3.14159, year 2024", " 42\n"])
def test_smollm2_decode_inverts_encode(smollm2: Any, text: str) -> None:
    assert smollm2.decode(smollm2.encode(text)) == text


def test_smollm2_splits_digits_one_per_token(smollm2: Any) -> None:
    ids = smollm2.encode("in 2024, 31415 people")
    pieces = [smollm2.decode([token]) for token in ids]
    assert pieces == ["in", " ", "2", "0", "2", "4", ",", " ", "3", "1", "4", "1", "5", " people"]
    # llama.cpp's "smollm" pre-tokenizer isolates every digit before the GPT-2 regex runs.
    split = smollm2.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 2024")
    assert [piece for piece, _ in split] == ["x", "Ġ", "2", "0", "2", "4"]


def test_smollm2_special_tokens_follow_the_metadata(smollm2_file: GGUFFile, smollm2: Any) -> None:
    tokens = smollm2_file.metadata["tokenizer.ggml.tokens"]
    assert gguf_eos_token_ids(smollm2_file) == {0, 2}
    assert [tokens[0], tokens[2]] == ["<|endoftext|>", "<|im_end|>"]
    assert smollm2.bos_token == tokens[smollm2_file.metadata["tokenizer.ggml.bos_token_id"]]
    assert smollm2.eos_token == tokens[smollm2_file.metadata["tokenizer.ggml.eos_token_id"]]
    assert smollm2.pad_token == tokens[smollm2_file.metadata["tokenizer.ggml.padding_token_id"]]
    assert (smollm2.bos_token, smollm2.eos_token, smollm2.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    # tokenizer.ggml.add_bos_token is false: nothing is prepended.
    assert smollm2.encode("Hi") == smollm2.encode("Hi", add_special_tokens=False)
    assert smollm2.encode("<|im_start|><empty_output>") == [1, 16]
    assert smollm2.decode([1, 16, 2], skip_special_tokens=True) == ""
    assert gguf_tokenizer_spec(smollm2_file).source == str(smollm2_file.path)


def write_tokenizer_gguf(model_dir: Path, path: Path) -> Path:
    """A GGUF holding only the tokenizer metadata of the model in ``model_dir``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    add_tokenizer_metadata(writer, model_dir)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def with_metadata(file: GGUFFile, **changes: Any) -> GGUFFile:
    """``file`` with metadata keys ``tokenizer.ggml.<key>`` changed (None removes a key)."""
    changed = copy.copy(file)
    metadata = dict(file.metadata)
    for key, value in changes.items():
        metadata.pop(f"tokenizer.ggml.{key}", None)
        if value is not None:
            metadata[f"tokenizer.ggml.{key}"] = value
    changed.metadata = metadata
    return changed


@pytest.fixture(scope="module")
def created_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Tokenizer kind -> (model directory, its tokenizer GGUF) of a tiny created model."""
    models = {}
    for kind in ("bpe", "spm"):
        root = tmp_path_factory.mktemp(f"created-{kind}")
        model_dir = create_model(root / "model", "llama", "tiny", tokenizer=kind)
        models[kind] = (model_dir, write_tokenizer_gguf(model_dir, root / "tokenizer.gguf"))
    return models


@pytest.fixture(params=["bpe", "spm"])
def created(
    request: pytest.FixtureRequest, created_models: dict[str, tuple[Path, Path]]
) -> tuple[Path, Path]:
    return created_models[request.param]


@pytest.fixture
def created_spm(created_models: dict[str, tuple[Path, Path]]) -> GGUFFile:
    return open_gguf(created_models["spm"][1])


@pytest.fixture
def created_bpe(created_models: dict[str, tuple[Path, Path]]) -> GGUFFile:
    return open_gguf(created_models["bpe"][1])


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_created_tokenizer_survives_gguf(
    created: tuple[Path, Path], add_special_tokens: bool
) -> None:
    model_dir, gguf_path = created
    original = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rebuilt = gguf_tokenizer_spec(open_gguf(gguf_path)).backend
    expected = original.encode_batch(CREATED_TEXTS, add_special_tokens=add_special_tokens)
    actual = rebuilt.encode_batch(CREATED_TEXTS, add_special_tokens=add_special_tokens)
    for text, want, got in zip(CREATED_TEXTS, expected, actual, strict=True):
        assert got.ids == want.ids, text
        for skip in (True, False):
            decoded = original.decode(want.ids, skip_special_tokens=skip)
            assert rebuilt.decode(got.ids, skip_special_tokens=skip) == decoded, text


def test_created_gguf_names_the_configs_special_tokens(created: tuple[Path, Path]) -> None:
    model_dir, gguf_path = created
    file = open_gguf(gguf_path)
    spec = gguf_tokenizer_spec(file)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert (spec.bos_token, spec.eos_token, spec.pad_token) == (
        config["bos_token"],
        config["eos_token"],
        config["pad_token"],
    )
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert gguf_eos_token_ids(file) == set(generation["eos_token_id"])
    assert spec.chat_template == config["chat_template"]


def test_created_spm_config_matches_its_tokenizer(
    created_models: dict[str, tuple[Path, Path]],
) -> None:
    model_dir, _ = created_models["spm"]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    ids = {name: tokenizer.token_to_id(name) for name in ("<unk>", "<s>", "</s>", "<|im_end|>")}
    assert (ids["<unk>"], ids["<s>"], ids["</s>"]) == (0, 1, 2)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        ids["<s>"],
        ids["</s>"],
        ids["<unk>"],
    )
    assert generation["eos_token_id"] == [ids["</s>"], ids["<|im_end|>"]]
    assert tokenizer.id_to_token(3) == "<0x00>"
    assert tokenizer.id_to_token(258) == "<0xFF>"
    assert tokenizer.get_vocab_size() <= config["vocab_size"]
    assert tokenizer.encode("Hi").ids[0] == ids["<s>"]


def test_create_model_rejects_an_unknown_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown tokenizer 'sentencepiece'.*'bpe', 'spm'"):
        create_model(tmp_path / "model", tokenizer="sentencepiece")
    assert not (tmp_path / "model").exists()


def test_spm_gguf_falls_back_to_bytes(created_spm: GGUFFile) -> None:
    types = created_spm.metadata["tokenizer.ggml.token_type"]
    tokens = created_spm.metadata["tokenizer.ggml.tokens"]
    assert [tokens[i] for i in range(len(tokens)) if types[i] == 6][:2] == ["<0x00>", "<0x01>"]
    backend = gguf_tokenizer_spec(created_spm).backend
    encoding = backend.encode("猫🦙\n", add_special_tokens=False)
    # Neither character is in the corpus: their UTF-8 bytes (and "\n"'s) become byte tokens.
    assert encoding.tokens == [
        "▁",
        *(f"<0x{byte:02X}>" for byte in "猫🦙\n".encode()),
    ]
    assert backend.decode(encoding.ids) == "猫🦙\n"


def llama_cpp_spm(metadata: dict[str, Any], text: str, add_bos: bool) -> list[int]:
    """llama.cpp's SentencePiece tokenization (special tokens parsed), transcribed to Python.

    Special (control, unknown, user-defined) tokens are cut out longest first; a space is put
    before each stretch of text that starts the input or follows a special token; spaces become
    "▁"; the stretch is merged by :func:`spm_merge`; a piece outside the vocabulary is written as
    its UTF-8 byte tokens.
    """
    tokens = metadata["tokenizer.ggml.tokens"]
    ids = {token: index for index, token in enumerate(tokens)}
    types = metadata["tokenizer.ggml.token_type"]
    specials = sorted((t for t, k in zip(tokens, types, strict=True) if k in (2, 3, 4)), key=len)
    fragments: list[str | int] = [text] if text else []
    for special in reversed(specials):
        cut: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int):
                cut.append(fragment)
                continue
            for index, part in enumerate(fragment.split(special)):
                cut.extend([ids[special]] if index else [])
                cut.extend([part] if part else [])
        fragments = cut
    output = [metadata["tokenizer.ggml.bos_token_id"]] if add_bos else []
    after_special = True
    for fragment in fragments:
        if isinstance(fragment, int):
            output.append(fragment)
            after_special = True
            continue
        stretch = ((" " if after_special else "") + fragment).replace(" ", "▁")
        after_special = False
        for piece in spm_merge(stretch, ids, metadata["tokenizer.ggml.scores"]):
            if piece in ids:
                output.append(ids[piece])
            else:
                output.extend(ids[f"<0x{byte:02X}>"] for byte in piece.encode())
    return output


def spm_merge(text: str, ids: dict[str, int], scores: list[float]) -> list[str]:
    """llama.cpp's SPM merge loop: starting from characters, join the adjacent pair that makes
    the best-scoring vocabulary token (the leftmost on a tie) until no pair makes one."""
    symbols = list(text)
    following = [*range(1, len(symbols)), -1]
    preceding = list(range(-1, len(symbols) - 1))
    queue: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        merged = symbols[left] + symbols[right] if min(left, right) >= 0 else ""
        if merged in ids:
            heapq.heappush(queue, (-scores[ids[merged]], left, right, len(merged)))

    for right in range(1, len(symbols)):
        push(right - 1, right)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        stale = not symbols[left] or not symbols[right] or following[left] != right
        if stale or len(symbols[left]) + len(symbols[right]) != size:
            continue  # one side was merged into something else since
        symbols[left] += symbols[right]
        symbols[right] = ""
        following[left] = following[right]
        if following[right] >= 0:
            preceding[following[right]] = left
        push(preceding[left], left)
        push(left, following[left])
    return [symbol for symbol in symbols if symbol]


def test_spm_gguf_tokenizes_like_llama_cpp(created_spm: GGUFFile) -> None:
    backend = gguf_tokenizer_spec(created_spm).backend
    # Every fifth corpus line keeps the pure-Python reference quick.
    texts = [*CORPUS_LINES[::5], *EDGE_TEXTS, CREATED_TEXTS[-1]]
    for text, encoding in zip(texts, backend.encode_batch(texts), strict=True):
        assert encoding.ids == llama_cpp_spm(created_spm.metadata, text, add_bos=True), text


def test_pre_tokenizer_name_picks_llama_cpps_regexes(created_bpe: GGUFFile) -> None:
    def pieces(pre: str, text: str) -> list[str]:
        backend = gguf_tokenizer_spec(with_metadata(created_bpe, pre=pre)).backend
        return [backend.decode([t], skip_special_tokens=False) for t in backend.encode(text).ids]

    text = "in 2024 we're"
    # GPT-2's regex keeps the number whole, so BPE may merge its digits.
    assert pieces("gpt-2", text) == ["in", " ", "2024", " we", "'re"]
    assert pieces("smollm", text) == ["in", " ", "2", "0", "2", "4", " we", "'re"]
    # Llama 3's regex: numbers in threes, letters without the space, and BOS by default.
    assert pieces("llama-bpe", text) == ["<|begin_of_text|>", "in", " ", "202", "4", " we", "'re"]
    assert pieces("qwen2", text) == ["in", " ", "2", "0", "2", "4", " we", "'re"]
    assert {"smollm", "llama3", "qwen2", "tekken", "default", "gpt-2"} <= set(PRE_TOKENIZERS)


def test_add_bos_and_eos_flags_in_the_file_win(created_bpe: GGUFFile) -> None:
    def encode(**changes: Any) -> list[int]:
        ids: list[int] = (
            gguf_tokenizer_spec(with_metadata(created_bpe, **changes)).backend.encode("hi").ids
        )
        return ids

    bos, eos = 1, 0  # <|begin_of_text|>, <|endoftext|>
    plain = encode()
    assert bos not in plain  # gpt-2 adds nothing by default
    assert encode(pre="llama3") == [bos, *plain]
    assert encode(pre="llama3", add_bos_token=False) == plain
    assert encode(add_bos_token=True, add_eos_token=True) == [bos, *plain, eos]
    with pytest.raises(ModelLoadError, match=r"add_bos_token is true.*no tokenizer.ggml.bos"):
        encode(add_bos_token=True, bos_token_id=None)


def test_unknown_pre_tokenizer_uses_llama_cpps_default(
    created_bpe: GGUFFile, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="brigade.models.gguf_tokenizer"):
        unknown = gguf_tokenizer_spec(with_metadata(created_bpe, pre="not-a-pre-tokenizer"))
    assert "'not-a-pre-tokenizer' is unknown" in caplog.text
    assert "default pre-tokenizer" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="brigade.models.gguf_tokenizer"):
        default = gguf_tokenizer_spec(with_metadata(created_bpe, pre="default"))
    assert caplog.text == ""
    texts = ["in 2024, 123456 we're (here)!", *EDGE_TEXTS]
    assert [e.ids for e in unknown.backend.encode_batch(texts)] == [
        e.ids for e in default.backend.encode_batch(texts)
    ]
    # The default set splits runs of three digits and punctuation before the GPT-2 regex.
    pieces = default.backend.pre_tokenizer.pre_tokenize_str("1234567 a+b")
    assert [piece for piece, _ in pieces] == ["123", "456", "7", "Ġa", "+", "b"]


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", None])
def test_unsupported_tokenizer_model_is_refused(created_bpe: GGUFFile, model: str | None) -> None:
    file = with_metadata(created_bpe, model=model)
    with pytest.raises(
        ModelLoadError, match=rf"tokenizer.ggml.model is {model!r}.*'gpt2'.*'llama'"
    ):
        gguf_tokenizer_spec(file)
    with pytest.raises(ModelLoadError, match=str(created_bpe.path)):
        gguf_eos_token_ids(file)


def test_a_gguf_without_a_vocabulary_is_refused(created_bpe: GGUFFile) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer.ggml.tokens"):
        gguf_tokenizer_spec(with_metadata(created_bpe, tokens=None))
    with pytest.raises(ModelLoadError, match=r"needs tokenizer.ggml.merges"):
        gguf_tokenizer_spec(with_metadata(created_bpe, merges=None))
