"""Checks of the operating system's part of a launch: shared memory and ports.

Design choice: the pure decision (``shm_check(size)``) is split from the probe (``shm_size()``),
so a test can feed the decision the small /dev/shm it cannot create.
"""

from __future__ import annotations

import os
import socket

from sparktrain.doctor.checks import gib
from sparktrain.doctor.verdicts import Check

#: Below this, /dev/shm is too small for DataLoader workers and NCCL's shared-memory transport.
MIN_SHM_BYTES = 1 << 30
SHM_FIX = (
    "raise it: docker run --shm-size=8g (or --ipc=host); on Kubernetes mount an emptyDir with "
    "medium: Memory at /dev/shm; on a host, mount -o remount,size=8G /dev/shm"
)


#: torch's DataLoader workers hold up to workers x (prefetch_factor + 1) batches in /dev/shm.
TORCH_WORKERS, TORCH_PREFETCH = 2, 2


def torch_batch_limit(
    size: int, workers: int = TORCH_WORKERS, prefetch: int = TORCH_PREFETCH
) -> int:
    """The largest batch, in bytes, torch's own workers can hand over in ``size`` bytes of shm."""
    return size // (workers * (prefetch + 1))


def shm_check(size: int | None) -> Check:
    """The verdict on a ``/dev/shm`` of ``size`` bytes (``None``: no /dev/shm).

    sparktrain's own DataLoader workers (``ds.loader()``'s default) need none; torch's (and
    ``workers='torch'``) pass each batch through it, so the verdict says how large a batch fits.
    """
    if size is None:
        return Check(
            name="shm",
            verdict="warning",
            found="/dev/shm does not exist; DataLoader workers and NCCL need shared memory",
            fix=SHM_FIX,
            facts={"bytes": None},
        )
    limit = torch_batch_limit(size)
    facts = {"bytes": size, "minimum": MIN_SHM_BYTES, "torch_batch_bytes": limit}
    fits = (
        f"torch's DataLoader workers ({TORCH_WORKERS}, prefetch_factor {TORCH_PREFETCH}) hand "
        f"over batches of up to {limit / (1 << 20):.0f} MB through it; sparktrain's "
        "ds.loader() workers need none"
    )
    if size < MIN_SHM_BYTES:
        return Check(
            name="shm",
            verdict="warning",
            found=f"/dev/shm is {gib(size)}, under {gib(MIN_SHM_BYTES)}: {fits}; NCCL's "
            "shared-memory transport and larger batches fail with 'No space left on device' "
            "or bus errors",
            fix=SHM_FIX,
            facts=facts,
        )
    return Check(name="shm", verdict="ok", found=f"/dev/shm is {gib(size)}: {fits}", facts=facts)


def shm_size(path: str = "/dev/shm") -> int | None:
    """The size in bytes of the file system at ``path``, or ``None`` when it is missing."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_frsize * stat.f_blocks


def ports_check() -> Check:
    """Whether a free port can be bound on loopback and on this host's address."""
    host = socket.gethostname()
    facts: dict[str, object] = {"hostname": host}
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            facts["loopback_port"] = probe.getsockname()[1]
    except OSError as exc:
        return Check(
            name="ports",
            verdict="error",
            found=f"cannot bind a port on 127.0.0.1 ({exc})",
            fix="the rendezvous needs a free TCP port: check the firewall/sandbox and "
            "ip_local_port_range",
            facts=facts,
        )
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        return Check(
            name="ports",
            verdict="warning",
            found=f"loopback ports bind, but host name {host!r} does not resolve ({exc})",
            fix=f"add {host} to /etc/hosts or DNS: other nodes reach rank 0 by its address",
            facts=facts,
        )
    facts["address"] = address
    if address.startswith("127.") or address == "::1":
        return Check(
            name="ports",
            verdict="info",
            found=f"free ports bind on loopback; host name {host} resolves to {address} "
            "(loopback): fine on one machine, but other nodes cannot reach it by that name",
            fix=f"for multi-node runs, map {host} to a routable address (/etc/hosts or DNS), "
            "or set spark.driver.host",
            facts=facts,
        )
    return Check(
        name="ports",
        verdict="ok",
        found=f"free ports bind on loopback; {host} resolves to {address}",
        facts=facts,
    )
