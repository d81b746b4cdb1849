"""What every built-in KV manager checks the same way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypeVar

from brigade.interfaces import Request

__all__ = ["running_state"]


class _HasRequest(Protocol):
    request: Request


S = TypeVar("S", bound=_HasRequest)


def running_state(running: Mapping[str, S], request: Request, num_new_tokens: int) -> S | None:
    """The state of ``request`` if it holds pages, None if it is being admitted.

    Raises ``ValueError`` for a negative token count, or when another request object already
    holds pages under the same id.
    """
    if num_new_tokens < 0:
        raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
    state = running.get(request.request_id)
    if state is not None and state.request is not request:
        raise ValueError(
            f"request id {request.request_id!r} already holds KV pages for another request"
        )
    return state
