"""Inside one rank: set the process up, run the entrypoint, leave the result or the failure.

A rank starts as a fresh fork of the warm fork server (see :mod:`sparktrain.node.forkserver`), which
has imported torch but never runs user code. The worker makes the process look like the
caller's (working directory, ``sys.path``, environment), hosts the rendezvous store on rank 0
from a socket the agent already bound, runs the function or script, and writes its return value
or its exception with the traceback to the run's private directory. The exit code tells the
agent which of the two to read.

The rank's end belongs to us too. No process group is ever destroyed in a rank (see
:mod:`sparktrain.rank.process_groups`: that teardown can deadlock torch), and the rank leaves with
``os._exit``. As soon as its outcome is on disk, the rank says so on its status pipe; what runs
after that (the user's non-daemon threads, ``atexit`` handlers) gets the agent's exit grace
period, after which the agent kills the rank and the run goes on with the outcome it wrote.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import functools
import os
import pickle
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle

from sparktrain.contract import env
from sparktrain.contract.paths import error_path, payload_path, result_path, stack_path, wait_path
from sparktrain.ground import procfs, proctree
from sparktrain.launchplan.entrypoint import ScriptEntry
from sparktrain.rank import extensions, imports, process_groups, reporting, stores
from sparktrain.rank import horovod_alias as alias

_stack_file: Any = None


@dataclass(frozen=True)
class RankFds:
    """The descriptors a rank is born with, besides its stdout and stderr.

    Attributes:
        report: Write end of the pipe for ``sparktrain.report()`` lines.
        status: Write end of the pipe on which the rank says it has finished its function.
        listen: Rank 0's bound rendezvous socket, or ``None``.
    """

    report: int
    status: int
    listen: int | None


@dataclass(frozen=True, kw_only=True)
class RankRequest:
    """What the agent sends the fork server to start one rank.

    Attributes:
        rank: Global rank.
        env: The rank's whole environment.
        cwd: The caller's working directory.
        sys_path: The caller's ``sys.path``, so that its modules import in the rank.
        run_dir: The run's private directory (payload in, results out).
        script: The script to run, or ``None`` to run the pickled function in ``run_dir``.
        threads: Intra-op threads to set, or ``None`` to leave torch's choice.
        keep_value: Whether to write the return value back.
        store_timeout: Seconds the rendezvous store waits for peers.
        data_path: The rank's share of a DataFrame (Arrow IPC file), or ``None``.
        hang_timeout: The run's ``hang_timeout``: collectives get a longer timeout than it, so
            that the agent, not a collective, notices a hang first.
    """

    rank: int
    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    run_dir: str
    script: ScriptEntry | None
    threads: int | None
    keep_value: bool
    store_timeout: float = 1800.0
    data_path: str | None = None
    hang_timeout: float | None = None


def collective_timeout(hang_timeout: float) -> float:
    """Seconds a collective may wait when ``hang_timeout`` is set (longer, so ours fires first)."""
    return hang_timeout + max(10.0, hang_timeout / 2)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def caller_alive(server: int, caller: int) -> bool:
    """Whether the process that started the fork server (the caller) still owns it.

    When the caller dies, the kernel reparents the server, so its parent is no longer the caller.
    Where ``/proc`` cannot tell, the caller counts as alive (the server's own check stands).
    """
    parent = procfs.parent_of(server)
    return parent is None or parent == caller


def _become_caller(req: RankRequest) -> None:
    os.chdir(req.cwd)
    marks = os.environ.get(proctree.TREE_VAR)  # the fork server's, for what the rank starts
    os.environ.clear()
    os.environ.update(req.env)
    if marks:
        os.environ[proctree.TREE_VAR] = marks
    sys.path[:] = req.sys_path
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    global _stack_file  # noqa: PLW0603 - kept open for faulthandler for the rank's lifetime
    _stack_file = open(stack_path(req.run_dir, req.rank), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True, chain=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if req.threads is not None:
        import torch

        torch.set_num_threads(req.threads)
    if req.hang_timeout is not None:
        from torch.distributed import distributed_c10d

        wait = datetime.timedelta(seconds=collective_timeout(req.hang_timeout))
        distributed_c10d.default_pg_timeout = wait
        distributed_c10d.default_pg_nccl_timeout = wait  # type: ignore[attr-defined]


def _host_store(req: RankRequest, listen_fd: int) -> Any:
    """Start the run's TCPStore on the socket the agent bound (so the port is never raced)."""
    return stores.host_store(
        listen_fd,
        req.env["MASTER_ADDR"],
        int(req.env["MASTER_PORT"]),
        int(req.env["WORLD_SIZE"]),
        req.store_timeout,
    )


def _unwrap(value: Any) -> Any:
    """A DDP/FSDP wrapper cannot live outside its process group: return the inner module."""
    if "torch.nn.parallel.distributed" in sys.modules:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(value, DistributedDataParallel):
            return value.module
    if "torch.distributed.fsdp" in sys.modules:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(value, FullyShardedDataParallel):
            return value.module
    return value


def _run_entry(req: RankRequest) -> Any:
    """Run the training function (or script); again, as a joiner, while its replica group drops.

    Only a sharded in-place run (``sparktrain.elastic.mesh``) runs it again: a rank whose replica
    group lost a member leaves it and joins the run anew (see ``sparktrain.rank.replicas``).
    """
    while True:
        try:
            return _run_once(req)
        except BaseException as error:
            if "sparktrain.rank.replicas" not in sys.modules:
                raise
            from sparktrain.rank.replicas import rejoin_after

            if not rejoin_after(error):
                raise


def _run_once(req: RankRequest) -> Any:
    if req.script is not None:
        sys.argv = [req.script.path, *req.script.args]
        sys.path.insert(0, os.path.dirname(req.script.path))
        runpy.run_path(req.script.path, run_name="__main__")
        return None
    fn, args, kwargs = cloudpickle.loads(payload_path(req.run_dir).read_bytes())
    return fn(*args, **kwargs)


#: Files of the rank's start-up: sparktrain's own, and runpy's for scripts.
_PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep


def _start_up(filename: str) -> bool:
    return filename.startswith(_PACKAGE) or filename in ("<frozen runpy>", runpy.__file__)


def users_frames(tb: Any) -> Any:
    """``tb`` from the first frame that is not the rank's start-up (all of it if none is)."""
    first = tb
    while tb is not None and _start_up(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb if tb is not None else first


def _describe(exc: BaseException) -> tuple[str, str]:
    """The exception's message and traceback as text, even when its ``__str__`` fails.

    The traceback starts at the user's code: the frames of the rank's start-up (this module,
    the front doors' wrappers, runpy) are left out, as ``python script.py`` leaves out its own.
    """
    try:
        message = str(exc)
    except Exception as err:
        message = f"<str() of the exception failed: {err!r}>"
    shown = users_frames(exc.__traceback__)
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, shown))
    except Exception:
        tb = "".join(traceback.format_tb(shown)) + f"{type(exc).__qualname__}\n"
    return message, tb


def _record_failure(req: RankRequest, exc: BaseException, message: str | None = None) -> None:
    text, tb = _describe(exc)
    record = {
        "time": time.time(),
        "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": message if message is not None else text,
        "traceback": tb,
    }
    _write_atomic(error_path(req.run_dir, req.rank), pickle.dumps(record))
    if req.script is not None:  # a script's uncaught exception shows in its log, as in python
        sys.stderr.write(tb)


def _fetch_kept_checkpoint(req: RankRequest) -> None:
    """On a restart, fetch the kept checkpoint files this node lacks from the survivors' memory."""
    from sparktrain.rank.checkpoints import gather

    if gather.needed():
        connect = functools.partial(stores.contract_store, req.store_timeout)
        rank, size = env.contract_rank(), env.contract_world_size()
        gather.run(rank, size, connect, req.store_timeout, _in_place_loss())


def _in_place_loss() -> Callable[[], bool]:
    """Whether this in-place attempt lost a rank (a later generation is named); never, else."""
    if env.in_place_store() is None:
        return lambda: False
    from sparktrain.contract.inplace import members
    from sparktrain.rank.replicas import in_place_store

    store = in_place_store()
    return lambda: bool(store.check([members(1)]))


def _checkpoints_published() -> None:
    """Wait for a checkpoint still being written and kept (its failure fails the rank)."""
    writer = sys.modules.get("sparktrain.rank.checkpoints.writer")
    if writer is not None:
        writer.WRITER.settle()


def _announce(status_fd: int, code: int) -> None:
    """Tell the agent the rank's outcome is recorded (``0``: value, ``1``: failure)."""
    with contextlib.suppress(OSError):
        os.write(status_fd, b"%d\n" % code)
        os.close(status_fd)


def exit_rank(code: int) -> None:
    """End the rank the way Python would, minus the module teardown.

    Joins the user's non-daemon threads and runs ``atexit`` handlers as a normal exit does, then
    leaves with ``os._exit``: tearing down torch's modules at interpreter exit costs 0.5-1 s per
    rank and does nothing useful, and destroying a process group there can deadlock. If the
    threads or the handlers never end, the agent kills the rank after its exit grace period.
    """
    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def run_rank(req: RankRequest, fds: RankFds, server: int, caller: int) -> int:
    """Run one rank to the end; return its exit code (0: value written, 1: failure written).

    Args:
        req: What to run.
        fds: The rank's report and status pipes and, on rank 0, the rendezvous socket.
        server: The fork server's PID (this process's parent).
        caller: The PID of the process that started the fork server.
    """
    procfs.die_with_parent(server)
    code = _run_and_record(req, fds, caller)
    reporting.flush()  # the newest report, held back by coalescing, still arrives
    _announce(fds.status, code)
    return code


def _run_and_record(req: RankRequest, fds: RankFds, caller: int) -> int:
    try:
        _become_caller(req)
        process_groups.install()
        reporting.attach(fds.report)
        stores.install()
        extensions.install(wait_path(req.run_dir, req.rank))
        if req.hang_timeout is not None:
            imports.watch()  # an import on the CPU is progress, not a hang
        if req.data_path is not None:
            from sparktrain.data import shard

            shard.set_path(req.data_path)
        if fds.listen is not None:  # kept until os._exit: a store is never torn down either
            process_groups.KEPT.append(_host_store(req, fds.listen))
        if not caller_alive(server=os.getppid(), caller=caller):
            os._exit(1)  # the caller died while this rank was being started: run nothing
        alias.add_finder()  # `import horovod.torch` works where Horovod is not installed
        _fetch_kept_checkpoint(req)
        value = _run_entry(req)
        _checkpoints_published()
        if req.keep_value:
            data = cloudpickle.dumps(_unwrap(value))
            _write_atomic(result_path(req.run_dir, req.rank), data)
    except SystemExit as exc:
        if exc.code in (None, 0):
            return 0
        _record_failure(req, exc, f"exited with code {exc.code!r}")
        return 1
    except BaseException as exc:
        _record_failure(req, exc)
        return 1
    return 0
