"""Horovod's build and runtime queries (``hvd.nccl_built()``, ``hvd.gloo_built()``, ...).

Code checks these to choose a path (``if hvd.nccl_built(): ...``). They answer for what
sparktrain's layer runs on: ``torch.distributed`` with gloo on CPUs and NCCL on GPUs, never MPI.
The types are Horovod's: ``nccl_built()`` is an ``int`` (``NCCL_VERSION_CODE``, 0 without
NCCL), the others are ``bool``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def nccl_built() -> int:
    """Torch's NCCL version as ``NCCL_VERSION_CODE`` (2.21.5 is 22105), or 0 without NCCL."""
    if not dist.is_nccl_available():
        return 0
    version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    if isinstance(version, int):  # older torch: already a code
        return version
    major, minor, patch = [*version, 0, 0, 0][:3]
    return int(major) * 10000 + int(minor) * 100 + int(patch)


def gloo_built() -> bool:
    """Whether gloo is there (it is, in every torch build that sparktrain runs on)."""
    return bool(dist.is_gloo_available())


def gloo_enabled() -> bool:
    """Whether collectives can run over gloo (CPU ranks use it)."""
    return gloo_built()


def mpi_built() -> bool:
    """Never: sparktrain's layer runs without MPI."""
    return False


def mpi_enabled() -> bool:
    """Never: sparktrain's layer runs without MPI."""
    return False


def cuda_built() -> bool:
    """Whether torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether torch was built with ROCm."""
    return torch.version.hip is not None


def ddl_built() -> bool:
    """Never: IBM DDL is not used."""
    return False


def ccl_built() -> bool:
    """Never: oneCCL is not used."""
    return False
