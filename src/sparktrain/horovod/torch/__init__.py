"""The parts of ``horovod.torch`` that training code uses, on ``torch.distributed``.

``init()`` joins the process group of the sparktrain launch it runs in (the torch contract:
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, the store sparktrain hosts), with
NCCL when the rank was given a GPU and gloo otherwise. Outside any launch it forms a group of
one, as Horovod does without ``horovodrun``. ``local_rank``/``local_size`` and
``cross_rank``/``cross_size`` come from the contract (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``NODE_RANK``, ``GROUP_WORLD_SIZE``).

Every other name of Horovod's API raises :class:`HorovodUnsupportedError`, which names it and
says what to use instead. Inside ranks started by :class:`sparktrain.HorovodRunner`, ``import
horovod.torch`` resolves to this module when Horovod is not installed (see
:mod:`sparktrain.rank.horovod_alias`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from sparktrain.contract import env
from sparktrain.contract.env import contract_int
from sparktrain.ground.errors import ConfigError
from sparktrain.horovod.torch.builds import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    nccl_built,
    rocm_built,
)
from sparktrain.horovod.torch.collectives import (
    Handle,
    ReduceOp,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    join,
    poll,
    require_init,
    synchronize,
)
from sparktrain.horovod.torch.compression import Compression
from sparktrain.horovod.torch.optimizer import DistributedOptimizer
from sparktrain.horovod.torch.unsupported import HorovodUnsupportedError, unsupported

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Handle",
    "HorovodUnsupportedError",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "nccl_built",
    "poll",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
    "synchronize",
]


def _backend() -> str:
    """NCCL when this rank was given a GPU (sparktrain sets ``CUDA_VISIBLE_DEVICES``), else gloo."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return "nccl" if given and torch.cuda.is_available() else "gloo"


def init(comm: object = None, process_sets: object = None) -> None:
    """Join the run's process group (a group of one outside any launch); idempotent."""
    if comm is not None or process_sets is not None:
        raise ConfigError(
            "hvd.init(comm=..., process_sets=...) is not supported: every rank of the launch "
            "forms one group. Use torch.distributed.new_group(ranks) for subsets."
        )
    if dist.is_initialized():
        return
    if env.launched():
        dist.init_process_group(_backend())
    else:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def is_initialized() -> bool:
    """Whether :func:`init` was called (and :func:`shutdown` was not)."""
    return dist.is_available() and dist.is_initialized()


def shutdown() -> None:
    """Leave the process group."""
    if is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    """This process's rank, 0 .. size() - 1."""
    require_init()
    return dist.get_rank()


def size() -> int:
    """The number of ranks."""
    require_init()
    return dist.get_world_size()


def local_rank() -> int:
    """This process's rank on its node."""
    require_init()
    return contract_int("LOCAL_RANK", 0)


def local_size() -> int:
    """The number of ranks on this node."""
    require_init()
    return contract_int("LOCAL_WORLD_SIZE", 1)


def cross_rank() -> int:
    """The index of this node."""
    require_init()
    return contract_int("GROUP_RANK", contract_int("NODE_RANK", 0))


def cross_size() -> int:
    """The number of nodes."""
    require_init()
    return contract_int("GROUP_WORLD_SIZE", 1)


def _flat_broadcast(tensors: list[torch.Tensor], root_rank: int) -> None:
    """Broadcast ``tensors`` in place: one collective per device and dtype."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    for group in buckets.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, src=root_rank)
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite every rank's parameters (or state dict) with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or a list of tensors.
        root_rank: The rank whose values win.
    """
    require_init()
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (str(i), p) for i, p in enumerate(params)]
    else:
        raise ConfigError(f"invalid params of type: {type(params).__name__}")
    tensors = [t for _, t in items if isinstance(t, torch.Tensor)]
    _flat_broadcast(tensors, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every rank ``root_rank``'s optimizer state (moments, steps, hyperparameters)."""
    require_init()
    state = broadcast_object(optimizer.state_dict(), root_rank)
    if dist.get_rank() != root_rank:
        optimizer.load_state_dict(state)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise unsupported(name)


def __dir__() -> list[str]:
    return sorted(__all__)
