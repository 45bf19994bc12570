"""Horovod names that ``sparktrain.horovod.torch`` does not provide, and what to use instead.

The module's ``__getattr__`` turns any other public name into :class:`HorovodUnsupportedError`,
so that code written for Horovod fails at the first call we do not cover, with the name and the
``torch.distributed`` equivalent, instead of an ``AttributeError`` that hides the reason. The
error is an ``AttributeError`` too, so ``hasattr`` and ``getattr(hvd, name, default)`` keep
working.
"""

from __future__ import annotations

#: Horovod API name -> what to use with torch.distributed.
SUGGESTIONS: dict[str, str] = {
    "alltoall": "torch.distributed.all_to_all_single(output, input)",
    "alltoall_async": "torch.distributed.all_to_all_single(output, input, async_op=True)",
    "reducescatter": "torch.distributed.reduce_scatter_tensor(output, input)",
    "reducescatter_async": "torch.distributed.reduce_scatter_tensor(..., async_op=True)",
    "grouped_allreduce": "one hvd.allreduce per tensor, or DistributedDataParallel",
    "grouped_allreduce_async": "torch.distributed.all_reduce(t, async_op=True) per tensor",
    "grouped_allreduce_": "torch.distributed.all_reduce(t) per tensor (in place)",
    "grouped_allgather": "hvd.allgather per tensor",
    "grouped_reducescatter": "torch.distributed.reduce_scatter_tensor per tensor",
    "sparse_allreduce_async": "dense gradients (DistributedOptimizer(sparse_as_dense=True))",
    "SyncBatchNorm": "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)",
    "ProcessSet": "torch.distributed.new_group(ranks)",
    "add_process_set": "torch.distributed.new_group(ranks)",
    "remove_process_set": "torch.distributed.destroy_process_group(group)",
    "global_process_set": "the default group (group=None in torch.distributed calls)",
    "elastic": "sparktrain's min_processes= with sparktrain.checkpoint (docs/elastic.md)",
    "mpi_threads_supported": "nothing: sparktrain runs without MPI (gloo on CPU, NCCL on GPU)",
    "start_timeline": "torch.profiler.profile(...)",
    "stop_timeline": "torch.profiler.profile(...)",
    "mpi_lib_v2": "nothing: sparktrain runs without MPI",
}

_DEFAULT = "the torch.distributed function of the same purpose (see docs/migration.md)"


class HorovodUnsupportedError(AttributeError, NotImplementedError):
    """A Horovod API name that ``sparktrain.horovod.torch`` does not provide."""


def unsupported(name: str) -> HorovodUnsupportedError:
    """The error for ``hvd.<name>``: names it and says what to use instead."""
    instead = SUGGESTIONS.get(name, _DEFAULT)
    return HorovodUnsupportedError(
        f"horovod.torch.{name} is not provided by sparktrain's Horovod layer "
        f"(sparktrain.horovod.torch, on torch.distributed); use {instead} instead, or install "
        "Horovod itself."
    )
