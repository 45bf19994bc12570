"""Inside a rank: a first-time C++ op build is progress, and a stopped one never blocks a run.

DeepSpeed, like every library that builds its ops with ``torch.utils.cpp_extension``, compiles an op
the first time a process loads it, into ``TORCH_EXTENSIONS_DIR``: about 30 s on a CPU for
DeepSpeed's ``deepspeed_shm_comm``, printing nothing. torch serialises the builders of an op with a
lock file (``FileBaton``), which a killed builder leaves behind
(:mod:`sparktrain.ground.buildlock`).

:func:`install` replaces the baton's three steps in the rank's process:

- **acquire** makes a lock whose staleness can be proven
  (:func:`sparktrain.ground.buildlock.create`), and first removes a stale one of ours, so that a
  build that sparktrain stopped (a timeout, a hang, Ctrl-C, a killed caller) never blocks the next
  run;
- **wait** is progress while the builder lives: the rank sends its agent a ``busy`` record every
  second (:func:`sparktrain.rank.reporting.busy`), so ``hang_timeout`` does not fire, and on a
  multi-node run the driver passes it to the other nodes, whose ranks wait in the rendezvous. A
  waiter whose builder dies removes the stale lock and builds the op itself (``_jit_compile`` is
  run again). A lock that nobody on this host holds and that is not ours is named in one line
  and in the run directory (:func:`sparktrain.contract.paths.wait_path`), where the hang report
  reads it;
- **hold** is progress too: a lock held for more than a second is a build, and one line says
  what is built and where it is kept; another says how long it took.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import itertools
import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from sparktrain.ground import buildlock
from sparktrain.rank import reporting

#: Seconds between ``busy`` records while a build is held or waited on.
BUSY_EVERY = 1.0
#: A lock held longer than this is a build (loading a built op holds it for milliseconds).
BUILD_AFTER = 1.0
#: How long a wait on an orphaned lock lasts before the rank names it.
ORPHAN_AFTER = 3.0
#: Times ``_jit_compile`` is run again after the builder it waited on died.
RETRIES = 3
_CPP_EXTENSION = "torch.utils.cpp_extension"


class _BuilderGone(Exception):
    """The builder this process waited on died; its stale lock was removed."""


class _Busy:
    """The rank's busy reasons, told to its agent every second by one daemon thread."""

    def __init__(self) -> None:
        self.reasons: dict[int, str] = {}
        self.keys = itertools.count()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def key(self) -> int:
        """A key for :meth:`set` (one per builder or waiter)."""
        return next(self.keys)

    def set(self, key: int, reason: str | None) -> None:
        """Be busy for ``reason`` under ``key`` (told at once), or no longer (``None``)."""
        with self.lock:
            if reason is None:
                self.reasons.pop(key, None)
                return
            if self.reasons.get(key) == reason:
                return
            self.reasons[key] = reason
            if self.thread is None:
                self.thread = threading.Thread(target=self._beat, name="sparktrain-busy")
                self.thread.daemon = True
                self.thread.start()
        reporting.busy(reason)

    def _beat(self) -> None:
        while True:
            time.sleep(BUSY_EVERY)
            with self.lock:
                reasons = list(self.reasons.values())
            if reasons:
                reporting.busy(reasons[0])


_busy = _Busy()
_wait_file: Path | None = None


def install(wait_file: Path | None) -> None:
    """Use sparktrain's build lock in this process (a rank, or ``sparktrain doctor``).

    Args:
        wait_file: Where to name an orphaned lock this rank waits on, for the hang report.
    """
    global _wait_file  # noqa: PLW0603 - one rank per process
    _wait_file = wait_file
    if "torch" not in sys.modules:  # a rank that never imports torch builds nothing
        return
    from torch.utils.file_baton import FileBaton

    FileBaton.try_acquire = _try_acquire  # type: ignore[method-assign]
    FileBaton.wait = _wait_for_build  # type: ignore[method-assign]
    FileBaton.release = _release  # type: ignore[method-assign]
    if _CPP_EXTENSION in sys.modules:
        _patch_jit(sys.modules[_CPP_EXTENSION])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def _say(line: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"sparktrain: {line}\n")
        sys.stderr.flush()


def _try_acquire(self: Any) -> bool:
    path = self.lock_file_path
    fd = buildlock.create(path)
    if fd is None and buildlock.clear_stale(path):
        _say(f"removed {path}: a build of {Path(path).parent.name!r} was stopped and left it")
        fd = buildlock.create(path)
    if fd is None:
        return False
    self.fd = fd
    self.sparktrain_released = threading.Event()
    self.sparktrain_hold = threading.Thread(
        target=_announce, args=(path, self.sparktrain_released), daemon=True
    )
    self.sparktrain_hold.start()
    return True


def _announce(path: str, released: threading.Event) -> None:
    """While the lock at ``path`` is held longer than a loading takes: say it builds, be busy."""
    started = time.monotonic()
    if released.wait(BUILD_AFTER):
        return
    op, folder = Path(path).parent.name, Path(path).parent
    _say(f"building the C++ op {op!r} (first time only; it is kept in {folder} for later runs)")
    key = _busy.key()
    _busy.set(key, f"building the C++ op {op!r}")
    try:
        released.wait()
    finally:
        _busy.set(key, None)
    _say(f"built the C++ op {op!r} in {time.monotonic() - started:.1f}s")


def _release(self: Any) -> None:
    fd, self.fd = self.fd, None
    buildlock.release(self.lock_file_path, fd)
    released = getattr(self, "sparktrain_released", None)
    if released is not None:
        released.set()
        self.sparktrain_hold.join(timeout=1.0)  # its last line before the caller's next


def _wait_for_build(self: Any) -> None:
    path = self.lock_file_path
    started = time.monotonic()
    named = False
    key = _busy.key()
    reason = f"waiting for the build of the C++ op {Path(path).parent.name!r}"
    try:
        while True:
            found = buildlock.state(path)
            if found.kind == "free":
                break
            if found.kind == "stale" and buildlock.clear_stale(path):
                raise _BuilderGone(path)
            if found.kind == "orphan":  # no builder to be seen: not busy, the hang clock runs
                _busy.set(key, None)
                if not named and time.monotonic() - started >= ORPHAN_AFTER:
                    named = True
                    _name_orphan(found)
                time.sleep(0.5)
                continue
            _busy.set(key, reason)
            time.sleep(0.1)
    finally:
        _busy.set(key, None)
    if named:  # removed by hand: whoever left it did not finish the build
        if _wait_file is not None:
            with contextlib.suppress(OSError):
                _wait_file.unlink()
        raise _BuilderGone(path)


def _name_orphan(found: buildlock.LockState) -> None:
    _say(f"waiting: {found.describe()}")
    if _wait_file is not None:
        with contextlib.suppress(OSError):
            _wait_file.write_text(json.dumps({"lock": found.path}))


def waited_lock(wait_file: Path) -> buildlock.LockState | None:
    """The lock a rank named in ``wait_file`` (for the hang report), as it is now."""
    try:
        path = json.loads(wait_file.read_text())["lock"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    found = buildlock.state(path)
    return found if found.kind != "free" else None


def _patch_jit(module: ModuleType) -> None:
    """Run ``_jit_compile`` again when the builder it waited on died (this process builds)."""
    original = getattr(module, "_jit_compile")  # noqa: B009 - private, typed nowhere
    if getattr(original, "sparktrain", False):
        return

    def _jit_compile(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(RETRIES + 1):
            try:
                return original(*args, **kwargs)
            except _BuilderGone as gone:
                op = Path(str(gone)).parent.name
                if attempt == RETRIES:
                    raise RuntimeError(f"every process that built {op!r} died ({gone})") from None
                _say(f"the build of {op!r} that this rank waited for did not finish; building it")
                # Forget the version torch noted, or it would take the op as built.
                name = kwargs.get("name", args[0] if args else None)
                versioner = getattr(module, "JIT_EXTENSION_VERSIONER", None)
                if versioner is not None:
                    versioner.entries.pop(name, None)
        raise AssertionError("unreachable")

    _jit_compile.sparktrain = True  # type: ignore[attr-defined]
    setattr(module, "_jit_compile", _jit_compile)  # noqa: B010


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patch ``torch.utils.cpp_extension`` when it is imported (it is not, in most ranks)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _CPP_EXTENSION:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _patch_jit(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
