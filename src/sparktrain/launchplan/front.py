"""Who launches: the few behaviours in which the originals' front doors differ from each other.

Every front door runs the same launch; what differs, on purpose, because the library each one
replaces behaves so, is described here once:

- the Spark conf that lets a run proceed on a cluster with TLS on (the original's own name);
- how the ranks own a Spark task's GPUs: ``rank`` gives each rank one GPU (as torchrun and
  pyspark's ``TorchDistributor``), ``task`` runs one rank per task that owns the task's share of
  the GPUs (as spark-tensorflow-distributor's workers, each a ``MirroredStrategy`` over its GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The conf that lets any sparktrain launch run on a TLS cluster anyway.
SPARKTRAIN_IGNORE_SSL = "spark.sparktrain.ignoreSsl"

GpuSharing = Literal["rank", "task"]


@dataclass(frozen=True)
class FrontDoor:
    """A front door, as the launch needs to know it.

    Attributes:
        name: Its name in messages (``TorchDistributor``).
        ignore_ssl_conf: The original's Spark conf that allows a TLS cluster
            (``pytorch.spark.distributor.ignoreSsl``); :data:`SPARKTRAIN_IGNORE_SSL` works too.
        gpus: ``rank`` (one GPU per rank) or ``task`` (one rank per Spark task, owning its
            share of the task's GPUs).
    """

    name: str = "sparktrain.launch"
    ignore_ssl_conf: str | None = None
    gpus: GpuSharing = "rank"

    def ignore_ssl_confs(self) -> tuple[str, ...]:
        """The confs, any of which set to ``true`` lets the run proceed on a TLS cluster."""
        own = (self.ignore_ssl_conf,) if self.ignore_ssl_conf else ()
        return (*own, SPARKTRAIN_IGNORE_SSL)


LAUNCH = FrontDoor()
TORCH_DISTRIBUTOR = FrontDoor("TorchDistributor", "pytorch.spark.distributor.ignoreSsl")
DEEPSPEED_DISTRIBUTOR = FrontDoor(
    "DeepspeedTorchDistributor", "deepspeed.spark.distributor.ignoreSsl"
)
MIRRORED_STRATEGY_RUNNER = FrontDoor(
    "MirroredStrategyRunner", "tensorflow.spark.distributor.ignoreSsl", gpus="task"
)
