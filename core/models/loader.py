"""Reads a Hugging Face-format model directory: config.json, dtype and safetensors weights.

Every problem a user can cause (a wrong path, a missing or corrupt file) raises
:class:`~brigade.errors.ModelLoadError` naming the file and what was expected.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from brigade.errors import ModelLoadError
from brigade.interfaces.executor import DTYPE_NAMES
from brigade.user_json import read_json_file

__all__ = [
    "DTYPES",
    "iter_safetensors",
    "read_hf_config",
    "resolve_dtype_name",
    "safetensors_shapes",
    "weight_files",
]

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
"""Model dtype names a config may give, and their torch dtypes."""

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def _model_dir(path: str | os.PathLike[str]) -> Path:
    directory = Path(path).expanduser()
    if not directory.exists():
        raise ModelLoadError(f"model directory {directory} does not exist")
    if not directory.is_dir():
        raise ModelLoadError(f"model path {directory} is not a directory")
    return directory


def _read_json(file: Path, what: str) -> Any:
    try:
        return read_json_file(file)
    except FileNotFoundError:
        raise ModelLoadError(f"{file} not found: a model directory needs {what}") from None
    except OSError as error:
        raise ModelLoadError(f"{file}: cannot read ({error})") from error
    except ValueError as error:
        raise ModelLoadError(f"{file} is not valid JSON: {error}") from error


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The model directory's ``config.json`` as a dict.

    Raises ``ModelLoadError`` for a missing directory, a missing or corrupt config.json, or
    one without a non-empty ``architectures`` list of names.
    """
    file = _model_dir(path) / "config.json"
    config = _read_json(file, "a Hugging Face config.json")
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, got {type(config).__name__}")
    architectures = config.get("architectures")
    if (
        not isinstance(architectures, list)
        or not architectures
        or not all(isinstance(name, str) for name in architectures)
    ):
        raise ModelLoadError(
            f"{file}: no 'architectures' list; expected e.g. \"architectures\": "
            '["LlamaForCausalLM"]'
        )
    return config


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files holding the weights, in load order.

    ``model.safetensors.index.json`` (sharded) wins, then ``model.safetensors``, then every
    ``*.safetensors`` in the directory.
    """
    directory = _model_dir(path)
    index_file = directory / _INDEX_FILE
    if index_file.exists():
        index = _read_json(index_file, "a safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_file}: expected a non-empty 'weight_map' object")
        files = [directory / str(name) for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{index_file} lists shard(s) missing from {directory}: {', '.join(missing)}"
            )
        return files
    if (directory / _SINGLE_FILE).is_file():
        return [directory / _SINGLE_FILE]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors in {directory}: weights must be safetensors "
            f"({_SINGLE_FILE} or a sharded {_INDEX_FILE})"
        )
    return files


def safetensors_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, read from the safetensors headers (no tensor data); empty for a
    directory without weights (a config-only one, which the simulated executor reads).
    ``ModelLoadError`` naming the file for one that is not safetensors."""
    directory = _model_dir(path)
    if not (directory / _INDEX_FILE).exists() and not any(directory.glob("*.safetensors")):
        return {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(directory):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as error:  # safetensors raises its own error types
            raise ModelLoadError(f"{file} is not a valid safetensors file: {error}") from error
    return shapes


def iter_safetensors(
    path: str | os.PathLike[str],
    dtype: torch.dtype,
    device: torch.device | str,
    slice_of: Callable[[str], tuple[int, int, int] | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor, floating ones cast to ``dtype``, on ``device``.

    Files are opened one at a time and tensors read one at a time, so peak memory stays near
    one tensor beyond the model. With ``slice_of`` (see ``Checkpoint.weight_slices``) only
    the named slice of a tensor is read from the file. A corrupt file raises
    ``ModelLoadError`` naming it.
    """
    for file in weight_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as error:  # safetensors raises its own error types
            raise ModelLoadError(f"{file} is not a valid safetensors file: {error}") from error
        with handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                part = None if slice_of is None else slice_of(name)
                try:
                    if part is None:
                        tensor = handle.get_tensor(name)
                    else:
                        dim, start, length = part
                        index = (slice(None),) * dim + (slice(start, start + length),)
                        tensor = handle.get_slice(name)[index]
                except Exception as error:
                    raise ModelLoadError(
                        f"{file}: cannot read tensor {name!r} (truncated or corrupt file?): {error}"
                    ) from error
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype=dtype)
                yield name, tensor.to(device)


def resolve_dtype_name(name: str, hf_config: Mapping[str, Any]) -> str:
    """The model dtype's name for ``[model] dtype`` = ``name``: a key of :data:`DTYPES`.

    ``"auto"`` takes config.json's ``dtype`` (or the older ``torch_dtype``) and falls back to
    float32 when neither is set; otherwise ``name`` is one of :data:`DTYPES`.
    """
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not supported; allowed: auto, {', '.join(DTYPES)}")
        return name
    for key in ("dtype", "torch_dtype"):
        value = hf_config.get(key)
        if value is None:
            continue
        value = str(value).removeprefix("torch.")
        if value not in DTYPES:
            raise ModelLoadError(
                f"config.json {key}={value!r} is not a supported model dtype; allowed: "
                f"{', '.join(DTYPES)} (or set [model] dtype explicitly)"
            )
        return value
    return "float32"
