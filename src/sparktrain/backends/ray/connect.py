"""Which Ray a run uses: the one this process initialised, one it joins, or one it starts.

:func:`connect` is the backend's: a Ray this process already initialised is used as it is; else
``ray.init(address=...)`` joins the one named (``RAY_ADDRESS``), or starts a local Ray for this
process, kept by a keeper (:mod:`sparktrain.backends.ray.keeper`) that ends it if the caller is
killed. :func:`start_local` is the explicit warm Ray, kept up across launches.
"""

from __future__ import annotations

import os
from typing import Any

from sparktrain.backends.ray import keeper
from sparktrain.ground.errors import ConfigError

INSTALL_HINT = "backend='ray' needs Ray: pip install 'sparktrain[ray]'"


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`ConfigError` with the install hint."""
    try:
        import ray
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return ray


def connect(address: str | None = None) -> tuple[Any, bool]:
    """The Ray this process uses: the initialised one, else ``ray.init(address=address)``.

    Returns:
        The ``ray`` module, and whether this call started a local Ray (kept by a keeper).
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray, False
    # With no address, Ray joins the cluster it finds named in /tmp/ray/ray_current_cluster (the
    # last one started on the machine, dead or not); the documented choice is RAY_ADDRESS, else
    # a Ray of this process's own.
    if address is None and not os.environ.get("RAY_ADDRESS"):
        address = "local"
    ray.init(address=address, log_to_driver=True)
    session = keeper.session_dir(ray)
    if session is not None:
        keeper.watch(session)
    return ray, session is not None


def start_local(**init_options: Any) -> Any:
    """Start a local Ray that stays up across launches, until this process exits.

    The explicit warm Ray: ``launch(..., backend="ray")`` then joins it and leaves it running,
    where a Ray it starts itself is stopped when the launch returns. It is stopped like any
    Ray: ``ray.shutdown()``, Ray's exit hook at a normal exit, and a keeper when this process is
    killed. ``init_options`` go to ``ray.init`` (``num_cpus=...``, say).

    Returns:
        What ``ray.init`` returned.

    Raises:
        ConfigError: Ray is not installed (the message has the install hint), a Ray is
            already initialised in this process, or ``address=`` named a cluster to join.
    """
    ray = import_ray()
    if ray.is_initialized():
        raise ConfigError(
            "sparktrain.ray.start_local(): Ray is already initialised in this process; "
            "launch(..., backend='ray') uses it as it is (call ray.shutdown() first to start anew)"
        )
    # "local": a Ray of its own, not the last one started on the machine (which Ray would join).
    context = ray.init(**{"address": "local", **init_options})
    session = keeper.session_dir(ray)
    if session is None:
        ray.shutdown()
        raise ConfigError(
            "sparktrain.ray.start_local() joined an existing Ray (RAY_ADDRESS or an address "
            "was given) instead of starting one; use ray.init(address=...) to join a cluster"
        )
    keeper.watch(session)
    return context
