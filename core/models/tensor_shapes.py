"""Does a model's config describe its weights? Checked from the tensors' shapes alone (the
safetensors headers, a GGUF file's tensor table), before a model is built from the config.

A config.json that claims a million layers over weights that hold four would otherwise build
a million-layer model (minutes, gigabytes) only to find the tensors missing; one that names a
wider hidden size or more heads than the tensors have fails the same way, late. The check
reads the Hugging Face tensor names every decoder Brigade runs uses (``model.layers.N.``,
``model.embed_tokens``, ``self_attn.q_proj``, ...) and says nothing about a tensor it does not
find: a checkpoint named otherwise is left to its architecture's loader.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from brigade.errors import ModelLoadError
from brigade.interfaces import Checkpoint

__all__ = [
    "check_config_matches_tensors",
    "check_weights_match_config",
    "checkpoint_tensor_shapes",
    "num_elements",
    "require_weights",
]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EMBEDDING = "model.embed_tokens.weight"
_FIRST_LAYER = "model.layers.0."


def checkpoint_tensor_shapes(checkpoint: Checkpoint) -> Mapping[str, tuple[int, ...]]:
    """The checkpoint's weight shapes (Hugging Face names) from its files' headers; empty
    when it holds no weights or is not one of Brigade's own kinds (nothing is known)."""
    from brigade.models.checkpoint import GGUFCheckpoint, HFCheckpoint

    if isinstance(checkpoint, HFCheckpoint | GGUFCheckpoint):
        return checkpoint.tensor_shapes()
    return {}


def check_weights_match_config(checkpoint: Checkpoint) -> None:
    """:func:`check_config_matches_tensors` for one of Brigade's checkpoints (nothing for a
    checkpoint of another kind, or one without weights): reads headers only, so it runs
    before a model is built."""
    from brigade.models.checkpoint import GGUFCheckpoint, HFCheckpoint

    if isinstance(checkpoint, HFCheckpoint | GGUFCheckpoint):
        check_config_matches_tensors(
            checkpoint.config, checkpoint.tensor_shapes(), checkpoint.config_source
        )


def require_weights(checkpoint: Checkpoint) -> None:
    """``ModelLoadError`` naming the files looked for when a Hugging Face folder holds no
    weights (a config-only one): an executor that loads weights would build the model from
    its config before finding none."""
    from brigade.models.checkpoint import HFCheckpoint
    from brigade.models.loader import weight_files

    if isinstance(checkpoint, HFCheckpoint):
        weight_files(checkpoint.directory)


def num_elements(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """How many values the tensors hold together."""
    total = 0
    for shape in shapes.values():
        count = 1
        for size in shape:
            count *= size
        total += count
    return total


def check_config_matches_tensors(
    config: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    source_of: Callable[[str], str],
) -> None:
    """``ModelLoadError`` naming both numbers when ``config``'s layer count, vocabulary, hidden
    size, attention or KV heads or MLP width disagree with ``shapes`` (Hugging Face names).

    ``source_of(key)`` says where a config key comes from, for the message (``config.json
    num_hidden_layers``, a GGUF file's ``llama.block_count``). Keys that are absent or not
    integers are left to the architecture's own validation, which names them.
    """

    def declared(key: str) -> int | None:
        value = config.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def refuse(key: str, value: int, found: str) -> None:
        raise ModelLoadError(f"{source_of(key)} = {value}, but {found}; they are not one model")

    layers = {int(match[1]) for name in shapes if (match := _LAYER.match(name))}
    num_layers = declared("num_hidden_layers")
    if layers and num_layers is not None and num_layers != max(layers) + 1:
        refuse(
            "num_hidden_layers",
            num_layers,
            f"the weights hold {max(layers) + 1} layers (layers 0 to {max(layers)})",
        )
    embedding = shapes.get(_EMBEDDING)
    if embedding is not None and len(embedding) == 2:
        for key, size, what in (
            ("vocab_size", embedding[0], "rows (tokens)"),
            ("hidden_size", embedding[1], "columns (the hidden size)"),
        ):
            value = declared(key)
            if value is not None and value != size:
                refuse(key, value, f"the embedding {_EMBEDDING} {embedding} has {size} {what}")
    _check_heads(declared, refuse, shapes)
    up = shapes.get(f"{_FIRST_LAYER}mlp.up_proj.weight")
    width = declared("intermediate_size")
    if up is not None and width is not None and up[0] != width:
        refuse("intermediate_size", width, f"{_FIRST_LAYER}mlp.up_proj.weight has {up[0]} rows")


def _check_heads(
    declared: Callable[[str], int | None],
    refuse: Callable[[str, int, str], None],
    shapes: Mapping[str, tuple[int, ...]],
) -> None:
    """Attention and KV heads times the head size against the q and k projections' rows."""
    num_heads, hidden_size = declared("num_attention_heads"), declared("hidden_size")
    head_dim = declared("head_dim")
    if head_dim is None and num_heads and hidden_size:
        head_dim = hidden_size // num_heads
    if not head_dim:
        return
    num_kv_heads = declared("num_key_value_heads")
    kv_key = "num_attention_heads" if num_kv_heads is None else "num_key_value_heads"
    for key, heads, projection in (
        ("num_attention_heads", num_heads, "q_proj"),
        (kv_key, num_heads if num_kv_heads is None else num_kv_heads, "k_proj"),
    ):
        name = f"{_FIRST_LAYER}self_attn.{projection}.weight"
        shape = shapes.get(name)
        if heads is None or shape is None or heads * head_dim == shape[0]:
            continue
        refuse(
            key,
            heads,
            f"{heads} heads of {head_dim} values need {heads * head_dim} rows in {name}, which "
            f"has {shape[0]} ({shape[0] / head_dim:g} heads)",
        )
