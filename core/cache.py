"""Where Brigade keeps what it builds once and reuses: models, compiled kernels, inductor's
caches (``$BRIGADE_CACHE_DIR``, default ``~/.cache/brigade``)."""

from __future__ import annotations

import os
import pathlib

__all__ = ["cache_root"]


def cache_root() -> pathlib.Path:
    """Return ``$BRIGADE_CACHE_DIR`` or ``~/.cache/brigade``."""
    env = os.environ.get("BRIGADE_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "brigade"
