"""Horovod's collectives on ``torch.distributed``: allreduce, allgather, broadcast, join.

Horovod negotiates each collective by name, so ranks may submit them in any order; here every
call is a ``torch.distributed`` collective on the default group, so every rank must make the
same calls in the same order (as training code does). ``name=`` is accepted and ignored.
Averages are computed as a sum followed by a division, since gloo has no ``AVG`` reduction;
``op=hvd.Adasum`` is :mod:`sparktrain.horovod.torch.adasum`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparktrain.ground.errors import ConfigError
from sparktrain.horovod.torch import adasum
from sparktrain.horovod.torch.compression import Compression, Compressor


class ReduceOp(enum.IntEnum):
    """Horovod's reduction operations (``hvd.Average``, ``hvd.Sum``, ...)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


_TORCH_OPS = {
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


def require_init() -> None:
    """Raise Horovod's error when ``hvd.init()`` was not called."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def check_op(op: object) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`; an unknown value raises :class:`ConfigError`."""
    try:
        return ReduceOp(op)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise ConfigError(
            f"op={op!r} is not a Horovod reduction; pass hvd.Average, hvd.Sum, hvd.Adasum, "
            "hvd.Min, hvd.Max or hvd.Product."
        ) from None


def resolve_op(op: object, average: bool | None) -> ReduceOp:
    """Horovod's ``average=`` (deprecated) and ``op=`` arguments as one :class:`ReduceOp`."""
    if op is not None and average is not None:
        raise ConfigError(f"pass op={op!r} or average={average!r}, not both.")
    if op is None:
        return ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    return check_op(op)


def _check_process_set(process_set: object) -> None:
    if process_set is not None:
        raise ConfigError(
            f"process_set={process_set!r}: only the global process set is supported; for a "
            "subset of ranks use torch.distributed.new_group(ranks) and its collectives."
        )


@dataclass
class Handle:
    """An asynchronous collective in flight; pass it to :func:`synchronize`."""

    work: Any
    output: torch.Tensor
    finish: Callable[[torch.Tensor], torch.Tensor]


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for an asynchronous collective and return its output."""
    handle.work.wait()
    return handle.finish(handle.output)


def poll(handle: Handle) -> bool:
    """Whether an asynchronous collective has completed."""
    return bool(handle.work.is_completed())


class _Done:
    """The work of a collective already completed (Adasum runs at once)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor != 1.0:
        tensor.mul_(factor)


def allreduce_async_(  # noqa: PLR0917 - Horovod's positional signature
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> Handle:
    """Start reducing ``tensor`` in place over every rank; returns a :class:`Handle`."""
    require_init()
    _check_process_set(process_set)
    reduce_op = resolve_op(op, average)
    _scale(tensor, prescale_factor)
    size = dist.get_world_size()

    def finish(out: torch.Tensor) -> torch.Tensor:
        _scale(out, postscale_factor)
        if reduce_op is ReduceOp.AVERAGE:
            if out.dtype.is_floating_point or out.dtype.is_complex:
                out.div_(size)
            else:
                out.floor_divide_(size)
        return out

    if reduce_op is ReduceOp.ADASUM:
        tensor.copy_(adasum.allreduce(tensor))
        return Handle(_Done(), tensor, finish)
    work = dist.all_reduce(tensor, op=_TORCH_OPS[reduce_op], async_op=True)
    return Handle(work, tensor, finish)


def allreduce_async(  # noqa: PLR0917 - Horovod's positional signature
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> Handle:
    """Start reducing a copy of ``tensor``; :func:`synchronize` returns the result."""
    return allreduce_async_(
        tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor, process_set
    )


def allreduce_(  # noqa: PLR0917 - Horovod's positional signature
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> torch.Tensor:
    """Reduce ``tensor`` in place over every rank (average by default) and return it."""
    handle = allreduce_async_(
        tensor, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return synchronize(handle)


def allreduce(  # noqa: PLR0917 - Horovod's positional signature
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> torch.Tensor:
    """The reduction of ``tensor`` over every rank (average by default), as a new tensor."""
    sent, ctx = compression.compress(tensor.detach())
    out = allreduce_(
        sent.clone(), average, name, op, prescale_factor, postscale_factor, process_set
    )
    return compression.decompress(out, ctx)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: object = None
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (sizes may differ)."""
    require_init()
    _check_process_set(process_set)
    size = dist.get_world_size()
    mine = tensor.detach().contiguous()
    if mine.dim() == 0:
        mine = mine.reshape(1)
    count = torch.tensor([mine.shape[0]], dtype=torch.int64, device=mine.device)
    counts = [torch.zeros_like(count) for _ in range(size)]
    dist.all_gather(counts, count)
    lengths = [int(c.item()) for c in counts]
    longest = max(lengths)
    if mine.shape[0] < longest:
        pad = mine.new_zeros((longest - mine.shape[0], *mine.shape[1:]))
        mine = torch.cat([mine, pad])
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine)
    return torch.cat([part[:n] for part, n in zip(parts, lengths, strict=True)])


def allgather_object(obj: object, name: str | None = None, process_set: object = None) -> list[Any]:
    """Every rank's ``obj`` (any picklable value), in rank order."""
    require_init()
    _check_process_set(process_set)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> Handle:
    """Start overwriting ``tensor`` with ``root_rank``'s; returns a :class:`Handle`."""
    require_init()
    _check_process_set(process_set)
    work = dist.broadcast(tensor, src=root_rank, async_op=True)
    return Handle(work, tensor, lambda out: out)


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> Handle:
    """Start broadcasting ``root_rank``'s ``tensor`` into a copy."""
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> torch.Tensor:
    """Overwrite ``tensor`` in place with ``root_rank``'s and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> torch.Tensor:
    """``root_rank``'s ``tensor``, as a new tensor on every rank."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_object(
    obj: object, root_rank: int = 0, name: str | None = None, process_set: object = None
) -> Any:
    """``root_rank``'s ``obj`` (any picklable value) on every rank."""
    require_init()
    _check_process_set(process_set)
    box = [obj if dist.get_rank() == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def barrier(process_set: object = None) -> None:
    """Wait until every rank gets here."""
    require_init()
    _check_process_set(process_set)
    dist.barrier()


def join(device: int = -1) -> int:
    """Wait until every rank has joined; return the rank that joined last.

    Unlike Horovod, ranks that joined do not take part in the collectives of ranks still
    training: every rank must run the same number of steps (``DistributedSampler`` does this),
    or the ranks still training wait for the ones that have left.
    """
    require_init()
    times = [float(t) for t in allgather_object(time.time())]
    return max(range(len(times)), key=times.__getitem__)
