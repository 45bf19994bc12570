"""What this machine offers: CPUs and GPUs. Read-only and lazy.

GPU discovery avoids importing torch when there is plainly no NVIDIA driver, so planning a CPU
run in a fresh process costs no torch import. With a driver present, ``torch.cuda.device_count()``
is the authority (it does not create a CUDA context); ``CUDA_VISIBLE_DEVICES`` names the
addresses the ranks will be given.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sparktrain.contract import env
from sparktrain.ground.errors import ClusterConfigError

_GPU_ADDRESS = re.compile(r"^(0|[1-9][0-9]*)$")


@dataclass(frozen=True)
class Topology:
    """The resources of one node.

    Attributes:
        cpus: CPUs this process may run on.
        gpus: Addresses of the GPUs visible here (as ``CUDA_VISIBLE_DEVICES`` entries).
        hostname: This host's name.
    """

    cpus: int
    gpus: tuple[str, ...]
    hostname: str


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def nvidia_driver_present() -> bool:
    """Whether this machine has an NVIDIA driver loaded (so asking CUDA is worth an import)."""
    return Path("/proc/driver/nvidia/gpus").is_dir() or Path("/dev/nvidiactl").exists()


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
    return int(torch.cuda.device_count())


def detect_gpus() -> tuple[str, ...]:
    """Addresses of the GPUs this process can use; empty when there are none."""
    visible = env.cuda_visible_devices()
    if visible == ():
        return ()
    if not nvidia_driver_present():
        return ()
    count = _cuda_device_count()
    if visible is not None:
        return visible[:count]
    return tuple(str(i) for i in range(count))


def detect_local(*, gpus: bool = True) -> Topology:
    """The topology of this machine, as seen by this process.

    Args:
        gpus: Look for GPUs (``False`` skips the look, which may import torch).
    """
    found = detect_gpus() if gpus else ()
    return Topology(cpus=_cpu_count(), gpus=found, hostname=socket.gethostname())


def spark_gpus(addresses: Sequence[str], visible: tuple[str, ...] | None) -> tuple[str, ...]:
    """Spark's GPU addresses as the devices to put in ``CUDA_VISIBLE_DEVICES``.

    Spark's address *i* is the *i*-th entry of the process's own ``CUDA_VISIBLE_DEVICES`` when it
    has one (``visible``; a cluster may set it through ``spark.executorEnv``), else device *i*:
    the reading of pyspark's ``TorchDistributor`` and spark-tensorflow-distributor.

    Raises:
        ClusterConfigError: An address that is not a plain integer, or past the end of
            ``visible``.
    """
    bad = [a for a in addresses if not _GPU_ADDRESS.match(a)]
    if bad:
        raise ClusterConfigError(
            f"Spark gave GPU addresses {list(addresses)}; {bad} are not plain integers "
            "(no zero padding), which CUDA_VISIBLE_DEVICES needs. Fix the GPU discovery script."
        )
    if visible is None:
        return tuple(addresses)
    outside = [a for a in addresses if int(a) >= len(visible)]
    if outside:
        raise ClusterConfigError(
            f"Spark gave GPU addresses {list(addresses)}, read as positions in this process's "
            f"CUDA_VISIBLE_DEVICES={','.join(visible)!r}, which has {len(visible)} entries; "
            "make the discovery script report positions in that list, or unset "
            "CUDA_VISIBLE_DEVICES for the executors."
        )
    return tuple(visible[int(a)] for a in addresses)
