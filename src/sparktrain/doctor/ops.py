"""DeepSpeed's C++ ops: build them ahead of a run (``sparktrain doctor --build-ops``), check them.

DeepSpeed compiles an op the first time a process loads it, unless it was installed with
``DS_BUILD_OPS=1``. On a CPU a run loads ``deepspeed_shm_comm`` as its process group starts
(about 30 s to build here); with a GPU a config's ``"optimizer"`` loads ``fused_adam`` and
offloading loads ``cpu_adam``. A built op lives in its own folder under ``TORCH_EXTENSIONS_DIR``
(torch's default: ``~/.cache/torch_extensions/py<version>_<cpu|cuXXX>``), and every later process
that points there loads it in milliseconds.

Design choices:
- The check (:func:`ops_check`) reads the folder only: no DeepSpeed import (seconds, and it
  prints), so ``sparktrain doctor`` stays fast. It names the build locks it finds that no
  builder holds (:mod:`sparktrain.ground.buildlock`), since they block every run that loads the op.
- :func:`build_ops` runs in the calling process, with the rank's own lock
  (:func:`sparktrain.rank.extensions.install`): a build stopped with Ctrl-C leaves a lock that
  the next run removes. Being asked explicitly, it first removes the locks that no process on
  this host holds, ours or not.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sparktrain.doctor.verdicts import Check
from sparktrain.ground import buildlock
from sparktrain.ground.errors import ConfigError

#: The ops a DeepSpeed process loads when its process group starts, by accelerator.
STARTUP_OPS = {"cpu": ("deepspeed_shm_comm",)}


@dataclass(frozen=True)
class BuiltOp:
    """One op that :func:`build_ops` built or loaded.

    Attributes:
        name: The op's name (``deepspeed_shm_comm``, ``cpu_adam``...).
        seconds: How long building or loading it took.
        folder: Where it is kept (empty for an op installed with DeepSpeed).
        error: Why it could not be built ("" when it was).
    """

    name: str
    seconds: float
    folder: str
    error: str = ""


def extensions_dir() -> str:
    """Where torch keeps built ops: ``TORCH_EXTENSIONS_DIR``, else torch's default.

    The default is named as ``torch.utils.cpp_extension`` names it: the user's cache folder,
    then the Python version and the accelerator torch was built for (``py311_cpu``).
    """
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return configured
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{python}_{accelerator}")


def _builders() -> dict[str, str]:
    """The accelerator's op builders: op name -> builder class name."""
    from deepspeed.accelerator import get_accelerator

    module = importlib.import_module(get_accelerator().op_builder_dir())
    found = {}
    for attr, value in vars(module).items():
        name = getattr(value, "NAME", None)
        if inspect.isclass(value) and attr.endswith("Builder") and isinstance(name, str):
            found[name] = attr
    return found


def build_ops(names: Sequence[str] | None = None) -> list[BuiltOp]:
    """Build DeepSpeed's ops here, ahead of a run (the ones a run loads at start by default).

    Args:
        names: The ops to build (``cpu_adam``, ``fused_adam``...); ``None`` or empty: those
            DeepSpeed loads when a process group starts on this accelerator.

    Raises:
        ConfigError: DeepSpeed is not installed, or a name is not an op of this accelerator.
    """
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("DeepSpeed is not installed: pip install --no-build-isolation deepspeed")
    from deepspeed.accelerator import get_accelerator

    from sparktrain.rank import extensions

    extensions.install(None)
    accelerator = str(get_accelerator().device_name())
    builders = _builders()
    wanted = list(names) if names else list(STARTUP_OPS.get(accelerator, ()))
    unknown = [n for n in wanted if n not in builders]
    if unknown:
        raise ConfigError(
            f"--build-ops {' '.join(unknown)}: not an op of DeepSpeed on {accelerator}; "
            f"choose from: {', '.join(sorted(builders))}"
        )
    root = extensions_dir()
    for lock in buildlock.locks_under(root):
        if buildlock.clear_orphan(lock.path):
            print(f"sparktrain: removed {lock.path}, which no process on this host held")
    return [_build(get_accelerator().create_op_builder(builders[n]), root) for n in wanted]


def _build(builder: object, root: str) -> BuiltOp:
    name = str(getattr(builder, "NAME", "?"))
    started = time.monotonic()
    try:
        if not builder.is_compatible():  # type: ignore[attr-defined]
            return BuiltOp(name, 0.0, "", error="not compatible with this machine")
        builder.load()  # type: ignore[attr-defined]
    except Exception as exc:
        return BuiltOp(name, time.monotonic() - started, "", error=f"{type(exc).__name__}: {exc}")
    folder = Path(root) / name
    return BuiltOp(name, time.monotonic() - started, str(folder) if folder.is_dir() else "")


def ops_check(root: str | None = None) -> Check:
    """The built ops under the extensions folder, and any lock that blocks one."""
    root = root or extensions_dir()
    folders = sorted(p for p in Path(root).glob("*") if p.is_dir()) if Path(root).is_dir() else []
    built = [f.name for f in folders if any(f.glob("*.so"))]
    facts = {"dir": root, "built": built}
    blocked = buildlock.locks_under(root)
    stuck = [lock for lock in blocked if lock.kind in ("stale", "orphan")]
    if stuck:
        return Check(
            name="ops",
            verdict="warning",
            found="; ".join(lock.describe() for lock in stuck),
            fix="sparktrain doctor --build-ops (removes them, then builds the ops a run needs)",
            facts={**facts, "stale_locks": [lock.path for lock in stuck]},
        )
    if importlib.util.find_spec("deepspeed") is None:
        return Check(name="ops", verdict="ok", found=f"C++ ops built in {root}: {len(built)}")
    missing = [op for op in STARTUP_OPS["cpu"] if op not in built]
    if missing and not _has_cuda():
        return Check(
            name="ops",
            verdict="info",
            found=f"DeepSpeed's {', '.join(missing)} is not built in {root}: the first DeepSpeed "
            "run builds it (about 30 s, first time only)",
            fix="build it ahead: sparktrain doctor --build-ops",
            facts=facts,
        )
    shown = ", ".join(built) or "none yet"
    return Check(name="ops", verdict="ok", found=f"C++ ops built in {root}: {shown}", facts=facts)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
