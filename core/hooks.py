"""Calling plugins' event hooks so that an observer that fails hurts nobody."""

from __future__ import annotations

import logging
from typing import Any

from brigade.errors import describe
from brigade.interfaces import Request

__all__ = ["notify_request_finished"]

logger = logging.getLogger(__name__)


def notify_request_finished(hook: Any, request: Request) -> None:
    """Call each ``brigade_request_finished`` implementation of ``hook`` (pluggy's hook relay)
    on its own: one that raises is logged, naming its plugin, and changes nothing for the
    request, the other observers or the engine."""
    for impl in hook.brigade_request_finished.get_hookimpls():
        if impl.hookwrapper or impl.wrapper:
            continue
        try:
            impl.function(**dict.fromkeys(impl.argnames, request))
        except Exception as exc:
            logger.error(
                "the brigade_request_finished hook of %s failed for request %s: %s",
                impl.plugin_name,
                request.request_id,
                describe(exc),
            )
