"""Plugins import from Brigade only its contracts and the few listed public modules.

A plugin, built-in (``plugins/``) or the example package (``examples/plugins/*/``), may import
the modules of ``brigade.interfaces.PUBLIC_MODULES`` (each with its submodules) and, for the
built-ins, each other (``brigade.plugins``); nothing else of core. The check reads the sources,
so it also sees imports inside functions or under ``TYPE_CHECKING``, ``from brigade import X``,
relative imports that climb out of ``brigade.plugins`` and ``importlib.import_module("...")``
with a literal name. A plugin's own tests (its ``tests/`` folder) may import anything.

Between built-in packages (``plugins/<package>/``) the same holds one level down: a file imports
its own package's modules freely, another package only through that package's root
(``brigade.plugins.<other>``) and only the names its ``__all__`` exports, never its modules.
``plugins/builtins.py``, which registers every component, is no package's and reads them all.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import brigade.errors
import brigade.interfaces
from brigade.interfaces import PUBLIC_MODULES

ROOT = Path(__file__).resolve().parents[2]
BUILTINS = ROOT / "plugins"
EXAMPLES = ROOT / "examples" / "plugins"
BUILTIN_ALLOWED = (*PUBLIC_MODULES, "brigade.plugins")


@dataclasses.dataclass(frozen=True, slots=True)
class ForbiddenImport:
    file: str
    line: int
    module: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.module}"


def forbidden_imports(
    source: str, *, filename: str, package: str, allowed: tuple[str, ...]
) -> list[ForbiddenImport]:
    """Every import of a ``brigade`` module that is not in ``allowed`` (nor below one).

    ``package`` is the dotted package the file belongs to, against which relative imports
    resolve (``brigade.plugins.executors`` for ``plugins/executors/torch_executor.py``).
    """
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        for module in _imported_modules(node, package):
            if _within(module, ("brigade",)) and not _within(module, allowed):
                found.append(ForbiddenImport(filename, getattr(node, "lineno", 0), module))
    return sorted(found, key=lambda f: f.line)


def _imported_modules(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _absolute(node, package)
        if base is None:
            return []
        if base == "brigade":  # each name may be a module (errors) or core's API (LLM)
            return [f"brigade.{alias.name}" for alias in node.names]
        return [base]
    if (
        isinstance(node, ast.Call)
        and _call_name(node.func) in ("import_module", "__import__")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def _absolute(node: ast.ImportFrom, package: str) -> str | None:
    """The module ``node`` imports from; None for a relative import above the top package
    (Python refuses it anyway)."""
    if node.level == 0:
        return node.module
    parts = package.split(".")
    if node.level > len(parts):
        return None
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def plugin_sources() -> Iterator[tuple[Path, str, tuple[str, ...]]]:
    """(file, its package, what it may import) for every plugin module, tests left out."""
    roots = [(BUILTINS, "brigade.plugins", BUILTIN_ALLOWED)]
    roots += [(d, "", PUBLIC_MODULES) for d in sorted(EXAMPLES.iterdir()) if d.is_dir()]
    for root, top, allowed in roots:
        for file in sorted(root.rglob("*.py")):
            folders = file.relative_to(root).parent.parts
            if "tests" in folders:
                continue
            yield file, ".".join(p for p in (top, *folders) if p), allowed


PLUGIN_FILES = list(plugin_sources())


@pytest.mark.parametrize(
    ("file", "package", "allowed"),
    PLUGIN_FILES,
    ids=[file.relative_to(ROOT).as_posix() for file, _, _ in PLUGIN_FILES],
)
def test_a_plugin_imports_only_the_public_api(
    file: Path, package: str, allowed: tuple[str, ...]
) -> None:
    found = forbidden_imports(
        file.read_text(encoding="utf-8"),
        filename=file.relative_to(ROOT).as_posix(),
        package=package,
        allowed=allowed,
    )
    assert not found, (
        "plugins may import only " + ", ".join(allowed) + " from Brigade (see PUBLIC_MODULES "
        "in brigade.interfaces and docs/plugins.md); anything else core must hand over in the "
        "factory's params:\n" + "\n".join(str(f) for f in found)
    )


def test_the_walk_covers_the_builtins_and_the_example_plugin() -> None:
    names = {file.relative_to(ROOT).as_posix() for file, _, _ in PLUGIN_FILES}
    assert "plugins/executors/torch_executor.py" in names
    assert "examples/plugins/brigade-sjf/brigade_sjf/scheduler.py" in names
    assert not any("/tests/" in name for name in names)


SYNTHETIC = """\
from typing import TYPE_CHECKING
import importlib
import torch
import brigade.interfaces.kv
from brigade.interfaces import Scheduler
from brigade import interfaces
from brigade.testing.conformance import check_scheduler
from brigade.cache import cache_root
from brigade.model_input import build_model_input
from ..kv import common
from . import priority
import brigade.engine
from brigade import errors, LLM
from brigade.interfacesX import Fake
from ... import scheduling
from ...models.checkpoint import open_checkpoint
import brigade
if TYPE_CHECKING:
    from brigade.config import EngineConfig


def load():
    from brigade.models.loader import read_hf_config
    return importlib.import_module("brigade.registry"), importlib.import_module("json")
"""


def test_the_checker_finds_every_way_to_reach_core() -> None:
    found = forbidden_imports(
        SYNTHETIC,
        filename="fake.py",
        package="brigade.plugins.schedulers",
        allowed=BUILTIN_ALLOWED,
    )
    assert [(f.line, f.module) for f in found] == [
        (12, "brigade.engine"),
        (13, "brigade.errors"),
        (13, "brigade.LLM"),
        (14, "brigade.interfacesX"),
        (15, "brigade.scheduling"),
        (16, "brigade.models.checkpoint"),
        (17, "brigade"),
        (19, "brigade.config"),
        (23, "brigade.models.loader"),
        (24, "brigade.registry"),
    ]
    assert str(found[0]) == "fake.py:12 imports brigade.engine"


def test_the_example_plugin_may_not_lean_on_the_builtins() -> None:
    source = "from brigade.plugins.schedulers.fcfs import FcfsScheduler\n"
    assert forbidden_imports(source, filename="x.py", package="sjf", allowed=PUBLIC_MODULES)
    assert not forbidden_imports(
        source, filename="x.py", package="brigade.plugins.kv", allowed=BUILTIN_ALLOWED
    )


def package_exports() -> dict[str, frozenset[str]]:
    """``brigade.plugins.<package>`` -> the names its ``__init__.py`` lists in ``__all__``."""
    exports = {}
    for init in sorted(BUILTINS.glob("*/__init__.py")):
        names: frozenset[str] = frozenset()
        for node in ast.parse(init.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
            ):
                names = frozenset(ast.literal_eval(node.value))
        exports[f"brigade.plugins.{init.parent.name}"] = names
    return exports


def cross_package_imports(
    source: str, *, filename: str, package: str, exports: dict[str, frozenset[str]]
) -> list[ForbiddenImport]:
    """Every import by a file of built-in ``package`` (``brigade.plugins.<name>`` or below) of
    another built-in package's module, or of a name its root does not export (reported as
    ``<root>.<name>``)."""
    own = ".".join(package.split(".")[:3])
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        for module in _imported_modules(node, package):
            if not _within(module, ("brigade.plugins",)) or _within(module, (own,)):
                continue
            line = getattr(node, "lineno", 0)
            root = ".".join(module.split(".")[:3])
            if module != root or root not in exports:
                found.append(ForbiddenImport(filename, line, module))
            elif isinstance(node, ast.ImportFrom):
                found += [
                    ForbiddenImport(filename, line, f"{root}.{alias.name}")
                    for alias in node.names
                    if alias.name not in exports[root]
                ]
    return sorted(found, key=lambda f: f.line)


BUILTIN_PACKAGE_FILES = [
    (file, package) for file, package, _ in PLUGIN_FILES if package.startswith("brigade.plugins.")
]


@pytest.mark.parametrize(
    ("file", "package"),
    BUILTIN_PACKAGE_FILES,
    ids=[file.relative_to(ROOT).as_posix() for file, _ in BUILTIN_PACKAGE_FILES],
)
def test_a_builtin_reaches_another_package_only_through_its_root(file: Path, package: str) -> None:
    found = cross_package_imports(
        file.read_text(encoding="utf-8"),
        filename=file.relative_to(ROOT).as_posix(),
        package=package,
        exports=package_exports(),
    )
    assert not found, (
        "a built-in plugin imports another package only as brigade.plugins.<package>, and only "
        "what that package's __init__ exports in __all__ (export it there):\n"
        + "\n".join(str(f) for f in found)
    )


CROSS_PACKAGE = """\
from brigade.plugins.executors.graph_runner import CapturedGraph
from brigade.plugins.executors import graph_padding
from brigade.plugins.cpu import cpu_ops
from brigade.plugins.cpu.gemm import CpuLinear
import brigade.plugins.cpu.build
from brigade.plugins.gpu import fused_ops, triton_runs_on
from ..models.decoder import RMSNorm
from ..models import TensorParallel
import brigade.plugins.cpu
from brigade.interfaces import LayerOps


def later():
    from brigade.plugins.attention.sdpa import SdpaBackend
    return importlib.import_module("brigade.plugins.kv.paged")
"""


def test_the_checker_finds_every_way_into_another_package() -> None:
    exports = {
        "brigade.plugins.cpu": frozenset({"cpu_ops"}),
        "brigade.plugins.gpu": frozenset({"triton_runs_on"}),
        "brigade.plugins.models": frozenset({"TensorParallel"}),
        "brigade.plugins.attention": frozenset({"SdpaBackend"}),
        "brigade.plugins.kv": frozenset(),
        "brigade.plugins.executors": frozenset(),
    }
    found = cross_package_imports(
        CROSS_PACKAGE, filename="fake.py", package="brigade.plugins.executors", exports=exports
    )
    assert [(f.line, f.module) for f in found] == [
        (4, "brigade.plugins.cpu.gemm"),
        (5, "brigade.plugins.cpu.build"),
        (6, "brigade.plugins.gpu.fused_ops"),
        (7, "brigade.plugins.models.decoder"),
        (14, "brigade.plugins.attention.sdpa"),
        (15, "brigade.plugins.kv.paged"),
    ]


def test_every_builtin_package_exports_what_it_lists() -> None:
    import importlib

    for root, names in package_exports().items():
        module = importlib.import_module(root)
        assert all(hasattr(module, name) for name in names), root


def test_the_public_modules_import_and_docs_plugins_md_lists_them() -> None:
    import importlib

    for module in PUBLIC_MODULES:
        importlib.import_module(module)
    text = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    # The paragraph that opens with this lead, then its list.
    paragraph_and_list = text.split("**What a plugin may import.**", 1)[1].split("\n\n")
    listed = re.findall(r"^- `(brigade[\w.]*)`", paragraph_and_list[1], flags=re.MULTILINE)
    assert listed == list(PUBLIC_MODULES)


def test_the_errors_plugins_raise_are_cores_own_classes() -> None:
    for name in ("BrigadeError", "ConfigError", "ModelLoadError", "RequestError"):
        assert getattr(brigade.interfaces, name) is getattr(brigade.errors, name), name
    assert issubclass(brigade.errors.UnknownComponentError, brigade.interfaces.BrigadeError)
