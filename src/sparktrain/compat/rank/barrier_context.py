"""Inside a rank on Spark: ``BarrierTaskContext.get()`` for code written for the original runner.

spark-tensorflow-distributor runs the training function inside the barrier task itself, so
functions written for it may call ``BarrierTaskContext.get()`` (``partitionId()``,
``allGather()``, ``barrier()``, ``getTaskInfos()``, ``resources()``). A sparktrain rank is a
process the task started, where pyspark's own context does not exist. :func:`install` makes
``BarrierTaskContext.get()`` (and ``TaskContext.get()``) return a :class:`RankBarrierContext`
in the rank: the same methods, answered through the run's rendezvous store (the ``TCPStore``
every rank already reaches), one partition per task as in the original. Its ``barrier`` and
``allGather`` are collective over the run's ranks, as Spark's are over the stage's tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparktrain.contract.env import (
    contract_int,
    contract_rank,
    cuda_visible_devices,
    restart_count,
)
from sparktrain.rank.stores import contract_store

_PREFIX = "sparktrain/barrier/"


@dataclass(frozen=True)
class TaskInfo:
    """One task's ``BarrierTaskInfo``: its ``address``."""

    address: str


@dataclass(frozen=True)
class Resource:
    """A ``ResourceInformation``: ``name`` and ``addresses``."""

    name: str
    addresses: list[str]


class RankBarrierContext:
    """``BarrierTaskContext``'s methods in a rank, through the run's store."""

    def __init__(self, store: Any, host: str) -> None:
        """Answer for this rank; ``store`` is a client of the run's ``TCPStore``."""
        self._store = store
        self._host = host
        self._rank = contract_rank()
        self._world = contract_int("WORLD_SIZE", 1)
        self._calls = 0

    def partitionId(self) -> int:
        """This task's partition: the rank (one rank per task, as in the original)."""
        return self._rank

    def allGather(self, message: str = "") -> list[str]:
        """Every task's ``message``, in partition order, once every task has sent its own."""
        if not isinstance(message, str):
            raise TypeError(f"allGather takes a string message, not {type(message).__name__}")
        self._calls += 1
        key = f"{_PREFIX}{self._calls}/"
        self._store.set(f"{key}{self._rank}", message)
        return [bytes(self._store.get(f"{key}{r}")).decode() for r in range(self._world)]

    def barrier(self) -> None:
        """Wait until every task has reached this barrier."""
        self.allGather("")

    def getTaskInfos(self) -> list[TaskInfo]:
        """Every task's address (``host``; the port is not Spark's and not given)."""
        return [TaskInfo(host) for host in self.allGather(self._host)]

    def resources(self) -> dict[str, Resource]:
        """This task's GPUs, as its rank sees them (``CUDA_VISIBLE_DEVICES``)."""
        visible = cuda_visible_devices()
        return {"gpu": Resource("gpu", list(visible))} if visible else {}

    def attemptNumber(self) -> int:
        """How many times the run was restarted before this attempt."""
        return restart_count()

    def stageId(self) -> int:
        """Not Spark's stage: 0."""
        return 0

    def getLocalProperty(self, key: str) -> str | None:
        """Spark's local properties do not reach the rank: ``None``."""
        return None

    def cpus(self) -> int:
        """The threads the rank was given."""
        return contract_int("OMP_NUM_THREADS", 1)


def install(host: str) -> RankBarrierContext:
    """Make ``BarrierTaskContext.get()`` and ``TaskContext.get()`` return this rank's context.

    pyspark's classes are patched in this process (the rank) only.
    """
    from pyspark import BarrierTaskContext, TaskContext

    context = RankBarrierContext(contract_store(), host)
    BarrierTaskContext.get = classmethod(lambda cls: context)  # type: ignore[method-assign,assignment]
    TaskContext.get = classmethod(lambda cls: context)  # type: ignore[method-assign,assignment]
    return context
