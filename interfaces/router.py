"""Router: which data-parallel engine replica a new request goes to.

With ``[router] data_parallel_size = N`` there are N engine replicas, each with its own
scheduler and KV cache. The router sees a request once, when it arrives, with every replica's
load as of then, and returns a replica index; core submits the request there and tells the
router when it finishes. The router owns whatever it remembers to decide (e.g. which prompt
prefixes it sent where, an estimate of each replica's prefix cache, as SGLang's router keeps);
it cannot look inside the replicas, because in a served deployment they are other processes.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

__all__ = ["ReplicaLoad", "Router", "RouterParams"]


@dataclasses.dataclass(frozen=True, slots=True)
class RouterParams:
    """What a router is built for."""

    num_replicas: int
    page_size: int
    """Tokens per KV page of every replica (prefix caches hold whole pages)."""
    num_pages: int = 0
    """KV pages of each replica; 0 when not known yet."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load as the router sees it when a request arrives."""

    index: int
    num_running: int
    """Requests in its running batch."""
    num_waiting: int
    """Requests queued behind them (routed there and not admitted yet)."""
    kv_usage: float
    """Share of its KV pages in use, 0 to 1."""

    @property
    def load(self) -> int:
        """Requests it holds: running and waiting."""
        return self.num_running + self.num_waiting


class Router(abc.ABC):
    """Places each new request on one replica.

    Constructed as ``factory(router_params: RouterParams, options)``. ``route`` is called
    once per request, in arrival order, from one thread. ``replicas`` lists the replicas in
    rotation, in index order: all ``num_replicas`` of them, or fewer once one has died (a
    served replica that fails is taken out; its ``index`` is then missing from the list).
    ``route`` returns the ``index`` of one of them (not a position in the list) and must not
    keep the lists it is given.
    """

    @abc.abstractmethod
    def route(
        self, request_id: str, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaLoad]
    ) -> int:
        """The replica index for this request."""

    def finished(self, request_id: str, replica: int) -> None:  # noqa: B027 (optional hook)
        """The request ``route`` placed on ``replica`` has finished or was aborted.
        Default: nothing."""
