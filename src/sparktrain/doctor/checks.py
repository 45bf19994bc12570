"""Checks of the training stack here, and whether a local launch of N ranks would be accepted.

Python, torch, CUDA and NCCL, GPUs, process-group backends (the operating system's part, shared
memory and ports, is in :mod:`sparktrain.doctor.system`).

Design choices:
- Each check is a function returning a :class:`~sparktrain.doctor.verdicts.Check`.
- torch is imported (it is a dependency and the question is about it), but no CUDA context is
  created beyond reading device properties, and no process is started.
- The local launch check calls the launcher's own planner
  (:func:`sparktrain.launchplan.layout.make_plan`) so that doctor's verdict and the launch's
  error are the same sentence.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from sparktrain.doctor.verdicts import Check
from sparktrain.ground.errors import ConfigError

MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 3)
CUDA_TORCH_FIX = (
    "install a CUDA build of torch that matches the driver, e.g. "
    "pip install torch --index-url https://download.pytorch.org/whl/cu126"
)


def gib(size: int) -> str:
    """``size`` bytes in GiB with one decimal: ``"23.5 GiB"``."""
    return f"{size / (1 << 30):.1f} GiB"


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numbers of a version: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``."""
    parts: list[int] = []
    for piece in text.split("+", maxsplit=1)[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _torch() -> ModuleType | None:
    try:
        import torch
    except ImportError:
        return None
    return torch


def python_check(version: tuple[int, int, int] | None = None) -> Check:
    """The interpreter's version against the supported minimum."""
    major, minor, micro = version or sys.version_info[:3]
    text = f"{major}.{minor}.{micro}"
    return _at_least(
        "python",
        f"Python {text}",
        (major, minor),
        MIN_PYTHON,
        ok=f"Python {text} ({sys.executable})",
        fix="use Python {need} or newer (the same one on the driver and the executors)",
        facts={"version": text, "executable": sys.executable},
    )


def torch_check() -> Check:
    """Whether torch imports, and its version against the supported minimum."""
    torch = _torch()
    if torch is None:
        return Check(
            name="torch",
            verdict="error",
            found="torch is not installed in this interpreter",
            fix="pip install torch (sparktrain needs torch>=2.3)",
        )
    version = str(torch.__version__)
    return _at_least(
        "torch",
        f"torch {version}",
        version_tuple(version)[:2],
        MIN_TORCH,
        ok=f"torch {version}",
        fix="pip install 'torch>={need}'",
        facts={"version": version},
    )


def _at_least(
    name: str,
    what: str,
    version: tuple[int, ...],
    minimum: tuple[int, ...],
    *,
    ok: str,
    fix: str,
    facts: dict[str, object],
) -> Check:
    """An error when ``version`` is below ``minimum`` (``{need}`` in ``fix`` names it), else ok.

    Args:
        name: The check's name.
        what: The thing and its version, as the error names it (``"torch 2.1.0"``).
        version: Its version's numbers, compared with ``minimum``.
        minimum: The oldest version sparktrain supports.
        ok: What the ok verdict says was found.
        fix: What to do, where ``{need}`` stands for the minimum.
        facts: The check's facts.
    """
    if version < minimum:
        need = ".".join(map(str, minimum))
        return Check(
            name=name,
            verdict="error",
            found=f"{what} is older than sparktrain supports ({need})",
            fix=fix.format(need=need),
            facts=facts,
        )
    return Check(name=name, verdict="ok", found=ok, facts=facts)


def _driver_present() -> bool:
    from sparktrain.launchplan.topology import nvidia_driver_present

    return nvidia_driver_present()


def cuda_check() -> Check:
    """The CUDA build of torch and whether CUDA works here, and its NCCL version."""
    torch = _torch()
    if torch is None:
        return Check(
            name="cuda", verdict="error", found="torch is missing", fix="pip install torch"
        )
    cuda = torch.version.cuda
    driver = _driver_present()
    facts: dict[str, object] = {"cuda": cuda, "driver": driver, "nccl": None}
    if cuda is None:
        if driver:
            return Check(
                name="cuda",
                verdict="warning",
                found="an NVIDIA driver is present but this torch is a CPU build",
                fix=CUDA_TORCH_FIX,
                facts=facts,
            )
        return Check(
            name="cuda",
            verdict="info",
            found="CPU build of torch (no CUDA, no NCCL); CPU runs use gloo",
            fix="for GPU training, " + CUDA_TORCH_FIX,
            facts=facts,
        )
    nccl = _nccl_version(torch)
    facts["nccl"] = nccl
    nccl_text = f", NCCL {nccl}" if nccl else ", no NCCL"
    if not torch.cuda.is_available():
        return Check(
            name="cuda",
            verdict="warning",
            found=f"torch built for CUDA {cuda}{nccl_text}, but CUDA is not usable here"
            + ("" if driver else " (no NVIDIA driver)"),
            fix="check nvidia-smi and that the driver supports CUDA "
            f"{cuda}; or run on CPU (use_gpu=False)",
            facts=facts,
        )
    return Check(name="cuda", verdict="ok", found=f"CUDA {cuda}{nccl_text}", facts=facts)


def _nccl_version(torch: ModuleType) -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a build without NCCL raises various errors
        return None
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    return str(version)


def gpus_check(*, use_gpu: bool | None = None) -> Check:
    """The GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applies) and their memory."""
    from sparktrain.launchplan.topology import detect_gpus

    addresses = detect_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    facts: dict[str, object] = {"count": len(addresses), "cuda_visible_devices": visible}
    if not addresses:
        hidden = " (CUDA_VISIBLE_DEVICES hides them all)" if visible is not None else ""
        found = f"no GPU visible{hidden}; launches run the ranks on CPU with gloo"
        if use_gpu is False:
            return Check(name="gpus", verdict="info", found=found, facts=facts)
        return Check(
            name="gpus",
            verdict="error" if use_gpu else "warning",
            found=found,
            fix="if you expected GPUs: check nvidia-smi, CUDA_VISIBLE_DEVICES and a CUDA build "
            "of torch; otherwise pass use_gpu=False (--cpu)",
            facts=facts,
        )
    torch = _torch()
    devices = []
    if torch is not None:
        for index in range(len(addresses)):
            props = torch.cuda.get_device_properties(index)
            devices.append({"name": props.name, "memory": int(props.total_memory)})
    facts["devices"] = devices
    shown = ", ".join(f"{d['name']} {gib(int(d['memory']))}" for d in devices)
    return Check(name="gpus", verdict="ok", found=f"{len(addresses)} GPU(s): {shown}", facts=facts)


def backends_check(*, gpus: int = 0) -> Check:
    """Which process-group backends torch.distributed offers (gloo for CPU, NCCL for GPUs)."""
    torch = _torch()
    if torch is None or not torch.distributed.is_available():
        return Check(
            name="backends",
            verdict="error",
            found="torch.distributed is not available in this torch build",
            fix="install a torch build with distributed support (the PyPI wheels have it)",
        )
    gloo = bool(torch.distributed.is_gloo_available())
    nccl = bool(torch.distributed.is_nccl_available())
    facts = {"gloo": gloo, "nccl": nccl}
    found = f"gloo {'yes' if gloo else 'no'}, nccl {'yes' if nccl else 'no'}"
    if not gloo:
        return Check(
            name="backends",
            verdict="error",
            found=found,
            fix="CPU runs need gloo: install the official torch wheels",
            facts=facts,
        )
    if gpus and not nccl:
        return Check(
            name="backends",
            verdict="error",
            found=found + f" with {gpus} GPU(s)",
            fix="GPU runs need NCCL: " + CUDA_TORCH_FIX,
            facts=facts,
        )
    return Check(name="backends", verdict="ok", found=found, facts=facts)


def local_launch_check(processes: int, *, use_gpu: bool | None = None) -> Check:
    """Whether a launch of ``processes`` ranks on this machine would be accepted, and how."""
    from sparktrain.launchplan.layout import make_plan
    from sparktrain.launchplan.topology import detect_local

    topology = detect_local()
    facts: dict[str, object] = {"processes": processes, "cpus": topology.cpus}
    try:
        plan = make_plan(processes, topology=topology, use_gpu=use_gpu)
    except ConfigError as exc:
        gpus = len(topology.gpus)
        if not gpus:
            fix = "pass use_gpu=False (--cpu) to train on CPU with gloo, or run where a GPU is seen"
        elif processes > gpus:
            fix = f"pass {gpus} processes or fewer (--processes {gpus}), or use_gpu=False (--cpu)"
        else:
            fix = "change the value the message names"
        return Check(name="launch.local", verdict="error", found=str(exc), fix=fix, facts=facts)
    facts.update(device=plan.device, backend=plan.dist_backend)
    if plan.device == "cpu" and processes > topology.cpus:
        return Check(
            name="launch.local",
            verdict="warning",
            found=f"{plan.describe()}: more ranks than the {topology.cpus} CPU(s) here, so they "
            "share cores and run slower",
            fix=f"use --processes {topology.cpus} or fewer for speed (the run still works)",
            facts=facts,
        )
    return Check(name="launch.local", verdict="ok", found=plan.describe(), facts=facts)
