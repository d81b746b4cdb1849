"""Ray for data-parallel replicas: ``[executor] distributed_executor_backend = "ray"``.

One helper places one actor per replica, each in its bundle of a placement group spread over
the cluster's nodes (``SPREAD``), and takes everything down again: ``brigade generate -dp N``
(``brigade.offline_replicas``) and ``brigade serve -dp N`` (``brigade.server.ray_replicas``)
both use it. ``RAY_ADDRESS`` names the cluster; without it Ray starts a local one for the run.
Ray is an extra (``pip install 'brigade-llm[ray]'``), imported only here and in the actors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from brigade.interfaces import ConfigError

__all__ = ["RAY_PLACEMENT_TIMEOUT_S", "replicas_on_ray", "require_ray", "spread_actors"]

RAY_PLACEMENT_TIMEOUT_S = 120.0
"""How long the replicas' placement group may wait for free CPUs (and GPUs) on the cluster."""


def replicas_on_ray(config: Any) -> bool:
    """Whether ``config`` places its data-parallel replicas on Ray: the torch executor's
    ``distributed_executor_backend`` option; an executor without it (the simulated one) runs
    them as local processes."""
    options = config["executor"].options
    return getattr(options, "distributed_executor_backend", "mp") == "ray"


def require_ray() -> ModuleType:
    """The ``ray`` module; a ``ConfigError`` naming the extra when it is not installed."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            '[executor] distributed_executor_backend = "ray" needs Ray: pip install '
            "'brigade-llm[ray]' (or use \"mp\": processes on this machine)"
        ) from None
    return ray


@contextlib.contextmanager
def spread_actors(
    actor_class: type,
    cpus: Sequence[int],
    *,
    gpus: Callable[[float], int] | None = None,
    max_concurrency: int = 1,
) -> Iterator[list[Any]]:
    """One actor of ``actor_class`` per entry of ``cpus`` (that many CPUs each), actor ``i``
    in bundle ``i`` of a placement group spread over the cluster's nodes. ``gpus`` says how
    many GPUs each actor asks for, given the cluster's count (none without it); Ray makes
    them the actor's visible CUDA devices. ``max_concurrency`` above 1 lets an actor answer a
    call while another runs (a stop while it serves).

    On leaving, every actor is killed, the placement group removed, and Ray shut down if this
    started it (else only the group and the actors go: the cluster is someone else's)."""
    ray = require_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(log_to_driver=False)  # RAY_ADDRESS names a cluster; without it, a local one
    group = None
    actors: list[Any] = []
    try:
        per_actor = 0 if gpus is None else gpus(ray.cluster_resources().get("GPU", 0.0))
        bundles = [{"CPU": n, "GPU": per_actor} if per_actor else {"CPU": n} for n in cpus]
        group = placement_group(bundles, strategy="SPREAD")
        try:
            ray.get(group.ready(), timeout=RAY_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"the Ray cluster did not find {bundles} for the replicas within "
                f"{RAY_PLACEMENT_TIMEOUT_S:g} s (ray status shows what it has); use fewer "
                "replicas or add nodes"
            ) from None
        remote_class = ray.remote(actor_class)
        for bundle, count in enumerate(cpus):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
            options = remote_class.options(
                num_cpus=count,
                num_gpus=per_actor,
                scheduling_strategy=strategy,
                max_concurrency=max_concurrency,
            )
            actors.append(options.remote())
        yield actors
    finally:
        for actor in actors:
            ray.kill(actor)
        if group is not None:
            remove_placement_group(group)
        if started_here:
            ray.shutdown()
