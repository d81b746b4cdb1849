"""GGUF files (llama.cpp's format): metadata, tensor layout and weights under Hugging Face names.

Metadata and tensor infos are parsed here in one pass over the memory-mapped header; tensor
data is dequantized with the ``gguf`` package's reference routines (``gguf.quants``), which
llama.cpp's own converters use. The ``gguf`` package's ``GGUFReader`` is not used to open
files: it builds one NumPy view per array element, which takes ~6 s on SmolLM2's 49k-token
vocabulary (and grows with the vocabulary); this parser reads the same header in ~0.1 s, and
the tests check that both agree on every field and tensor.

A model split into parts (``name-00001-of-00003.gguf``, as ``llama-gguf-split`` writes) is read
as one: metadata from the first part, tensors from all.

Every problem a user can cause raises :class:`~brigade.errors.ModelLoadError` naming the file,
the key or tensor, and what is supported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import re
import struct
from pathlib import Path
from typing import Any

from brigade.errors import ModelLoadError

__all__ = [
    "GGUF_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "GGUFFile",
    "GGUFTensor",
    "gguf_parts",
    "is_split_part",
    "open_gguf",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

SUPPORTED_TENSOR_TYPES: tuple[str, ...] = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
"""GGML tensor types Brigade dequantizes at load (by their ``gguf.GGMLQuantizationType`` names)."""

GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""``general.architecture`` -> the Hugging Face architecture Brigade runs it as. llama.cpp's
converter writes Mistral models as ``llama``; ``mistral`` is accepted from other writers."""

# GGUF value types (gguf.GGUFValueType): struct format of the scalars.
_SCALARS: dict[int, str] = {
    0: "B",  # UINT8
    1: "b",  # INT8
    2: "H",  # UINT16
    3: "h",  # INT16
    4: "I",  # UINT32
    5: "i",  # INT32
    6: "f",  # FLOAT32
    7: "?",  # BOOL
    10: "Q",  # UINT64
    11: "q",  # INT64
    12: "d",  # FLOAT64
}
_STRING, _ARRAY = 8, 9
_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFTensor:
    """Where one tensor lies in a (memory-mapped) GGUF file."""

    name: str
    shape: tuple[int, ...]
    """Torch order: GGUF's dimensions reversed, so a weight is [rows, columns]."""
    type_name: str
    """The GGML type's name, e.g. ``"Q4_K"``."""
    type_id: int
    offset: int
    """Absolute byte offset in ``file``."""
    nbytes: int
    file: Path


class GGUFFile:
    """The parsed header of one GGUF model (all parts of a split one) and its mapped data.

    ``metadata`` maps each key to a Python value: str, int, float, bool, or a list of them.
    Arrays of numbers are lists; arrays of strings (a vocabulary) are lists of str.
    """

    def __init__(self, paths: list[Path]) -> None:
        self.path = paths[0]
        self.paths = paths
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        for index, part in enumerate(paths):
            metadata, tensors = _parse(part)
            if index == 0:
                self.metadata = metadata
            for tensor in tensors:
                if tensor.name in self.tensors:
                    raise ModelLoadError(f"{part}: tensor {tensor.name!r} appears twice")
                self.tensors[tensor.name] = tensor

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the file has no such key."""
        return self.metadata.get(key, default)

    def data(self, tensor: GGUFTensor) -> memoryview:
        """The tensor's raw bytes (a view of the mapped file: no copy)."""
        mapped = self._maps.get(tensor.file)
        if mapped is None:
            with open(tensor.file, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[tensor.file] = mapped
        return memoryview(mapped)[tensor.offset : tensor.offset + tensor.nbytes]

    def close(self) -> None:
        """Unmap the files (tensors already returned stay valid: they are copies)."""
        for mapped in self._maps.values():
            # A caller still holding a view keeps its map open until the view goes.
            with contextlib.suppress(BufferError):
                mapped.close()
        self._maps.clear()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def architecture(self) -> str:
        """``general.architecture`` (e.g. ``"llama"``)."""
        value = self.metadata.get("general.architecture")
        if not isinstance(value, str):
            raise ModelLoadError(f"{self.path}: no general.architecture; not a model file?")
        return value


def is_split_part(path: Path) -> int:
    """The part number of a split model's file (``x-00002-of-00003.gguf`` -> 2), else 0."""
    match = _SPLIT_NAME.match(path.name)
    return int(match["part"]) if match else 0


def gguf_parts(path: Path) -> list[Path]:
    """``path`` alone, or every part of the split model it is the first part of."""
    match = _SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if int(match["part"]) != 1:
        first = path.with_name(f"{match['stem']}-00001-of-{match['count']}.gguf")
        raise ModelLoadError(
            f"{path} is part {int(match['part'])} of a split GGUF; point [model] path at "
            f"the first part, {first.name}"
        )
    parts = [
        path.with_name(f"{match['stem']}-{i:05d}-of-{match['count']}.gguf")
        for i in range(1, count + 1)
    ]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{path}: split GGUF of {count} parts is missing {', '.join(missing)}")
    return parts


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file (and its other parts, if split); tensors are read later, on demand."""
    return GGUFFile(gguf_parts(Path(path)))


class _Cursor:
    """Reads little-endian GGUF values from a buffer, naming the file when it runs out."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.size = len(buffer)
        self.path = path
        self.offset = 0

    def _need(self, nbytes: int) -> None:
        if self.offset + nbytes > self.size:
            raise ModelLoadError(
                f"{self.path} is truncated (needed {nbytes} bytes at offset {self.offset} of "
                f"{self.size}); re-download or re-convert it"
            )

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        self._need(length)
        raw = self.buffer[self.offset : self.offset + length]
        self.offset += length
        return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int, key: str) -> Any:
        if type_id == _STRING:
            return self.string()
        fmt = _SCALARS.get(type_id)
        if fmt is not None:
            return self.scalar(fmt)
        if type_id == _ARRAY:
            item_type = self.scalar("I")
            count = self.scalar("Q")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            item_fmt = _SCALARS.get(item_type)
            if item_fmt is None:
                raise ModelLoadError(f"{self.path}: {key}: arrays of type {item_type} are unknown")
            nbytes = struct.calcsize(item_fmt) * count
            self._need(nbytes)
            values = list(struct.unpack_from(f"<{count}{item_fmt}", self.buffer, self.offset))
            self.offset += nbytes
            return values
        raise ModelLoadError(f"{self.path}: {key}: unknown GGUF value type {type_id}")


def _parse(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below, the map outlives no call
    except OSError as error:
        raise ModelLoadError(f"cannot open {path}: {error.strerror or error}") from error
    with handle:
        try:
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ModelLoadError(f"{path} is empty, not a GGUF file") from None
    try:
        return _parse_buffer(buffer, path)
    finally:
        buffer.close()


def _parse_buffer(buffer: mmap.mmap, path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    cursor = _Cursor(buffer, path)
    _check_header(cursor, buffer, path)
    tensor_count = cursor.scalar("Q")
    kv_count = cursor.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("I"), key)
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = cursor.string()
        num_dims = cursor.scalar("I")
        dims = tuple(cursor.scalar("Q") for _ in range(num_dims))
        type_id = cursor.scalar("I")
        infos.append((name, dims, type_id, cursor.scalar("Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.offset // alignment) * alignment
    return metadata, _tensors(infos, data_start, len(buffer), path)


def _check_header(cursor: _Cursor, buffer: mmap.mmap, path: Path) -> None:
    """The magic and a supported version, read past."""
    cursor._need(4)
    if buffer[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    cursor.offset = 4
    version = cursor.scalar("I")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0:
            raise ModelLoadError(f"{path} is a big-endian GGUF; only little-endian is supported")
        raise ModelLoadError(
            f"{path}: GGUF version {version} is not supported; supported: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
        )


def _tensors(
    infos: list[tuple[str, tuple[int, ...], int, int]],
    data_start: int,
    file_size: int,
    path: Path,
) -> list[GGUFTensor]:
    """The tensors the header's ``infos`` (name, GGUF dims, type, offset in the data) describe,
    each checked to be of a known type, whole blocks per row, and inside the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors = []
    for name, dims, type_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has unknown GGML type {type_id}; supported: "
                f"{', '.join(SUPPORTED_TENSOR_TYPES)}"
            ) from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        elements = 1
        for size in dims:
            elements *= size
        if dims and dims[0] % block_size:
            raise ModelLoadError(
                f"{path}: tensor {name!r} ({qtype.name}) has rows of {dims[0]} values, not a "
                f"multiple of its block size {block_size}"
            )
        nbytes = elements // block_size * type_size
        start = data_start + offset
        if start + nbytes > file_size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {name!r} ends at byte {start + nbytes} of "
                f"{file_size}; re-download or re-convert it"
            )
        tensors.append(
            GGUFTensor(name, tuple(reversed(dims)), qtype.name, type_id, start, nbytes, path)
        )
    return tensors
