"""C++ op builds in ranks: a first build is progress, a stopped one never blocks the next run.

The small tests build a tiny C++ library with torch's own extension builder (the path DeepSpeed
takes), in a folder of their own, with a compiler wrapper that takes a few seconds when asked to:
a real build and a real lock, timed by the test. The DeepSpeed test builds its real op from an
empty folder, as a new machine does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import cloudpickle
import pytest

from conftest import ROOT, alive, wait_gone
from sparktrain import HangError, LocalCluster, launch
from sparktrain.ground import buildlock
from sparktrain.rank import stores

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks import no pytest: short clocks

TINY = 'extern "C" int sparktrain_tiny() { return 7; }\n'
OP = "sparktrain_tiny"


def tiny_op(source: str) -> str:
    """In a rank: build or load the tiny library with torch's extension builder; its path.

    A line first, so that the hang clock times the build, not the rank's start.
    """
    from torch.utils.cpp_extension import load

    print("loading the op", flush=True)
    return str(load(name=OP, sources=[source], is_python_module=False, verbose=False))


def build_on_rank_1(source: str) -> str:
    """Rank 1 builds the op; rank 0 waits for it at a barrier, printing nothing."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print("at the barrier", flush=True)
    path = tiny_op(source) if dist.get_rank() == 1 else ""
    dist.barrier()
    return path


@pytest.fixture
def ext(tmp_path: Path) -> Path:
    """An empty extension folder, with the tiny op's source beside it."""
    (tmp_path / "ext").mkdir()
    (tmp_path / "tiny.cpp").write_text(TINY)
    return tmp_path / "ext"


def env_for(ext: Path, compile_seconds: float = 0.0) -> dict[str, str]:
    """The ranks' variables: the folder, and a compiler that takes ``compile_seconds`` a file."""
    env = {"TORCH_EXTENSIONS_DIR": str(ext)}
    if compile_seconds:
        wrapper = ext.parent / "slow-c++"
        wrapper.write_text(
            f'#!/bin/sh\ncase " $* " in *" -c "*) sleep {compile_seconds};; esac\nexec c++ "$@"\n'
        )
        wrapper.chmod(0o755)
        env["CXX"] = str(wrapper)
    return env


def hold_lock(path: Path) -> subprocess.Popen[str]:
    """Another process that takes the lock as a sparktrain builder does, and keeps it."""
    code = textwrap.dedent(f"""
        import time
        from sparktrain.ground import buildlock
        fd = buildlock.create({str(path)!r})
        print("held" if fd is not None else "taken", flush=True)
        time.sleep(1000)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_build_longer_than_hang_timeout_is_progress(
    ext: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """One rank builds for about 6 s, the other waits for it; ``hang_timeout=3``: no hang."""
    source = str(ext.parent / "tiny.cpp")
    result = launch(
        tiny_op, (source,), num_processes=2, use_gpu=False, hang_timeout=3.0, timeout=120,
        env=env_for(ext, compile_seconds=6), return_all=True,
    )  # fmt: skip
    built = ext / OP / f"{OP}.so"
    assert dict(result.return_values) == {0: str(built), 1: str(built)}
    err = capfd.readouterr().err
    assert err.count(f"building the C++ op '{OP}' (first time only") == 1, err
    assert f"built the C++ op '{OP}' in" in err
    assert not (ext / OP / "lock").exists()


def test_a_build_on_one_node_is_progress_for_the_other_nodes(ext: Path) -> None:
    """Node 1's rank builds; node 0's rank waits at a barrier, silent: the driver passes it on."""
    source = str(ext.parent / "tiny.cpp")
    result = launch(
        build_on_rank_1, (source,), num_processes=2, use_gpu=False, hang_timeout=3.0,
        timeout=120, backend=LocalCluster(nodes=2), env=env_for(ext, compile_seconds=7),
        return_all=True,
    )  # fmt: skip
    assert dict(result.return_values) == {0: "", 1: str(ext / OP / f"{OP}.so")}


def test_a_lock_left_by_a_killed_builder_is_removed_and_the_op_built(
    ext: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    lock = ext / OP / "lock"
    lock.parent.mkdir()
    holder = hold_lock(lock)
    holder.kill()
    holder.wait()
    assert buildlock.state(str(lock)).kind == "stale"
    source = str(ext.parent / "tiny.cpp")
    path = launch(tiny_op, (source,), num_processes=1, use_gpu=False, timeout=60, env=env_for(ext))
    assert path.value == str(ext / OP / f"{OP}.so")
    assert f"removed {lock}: a build of '{OP}' was stopped and left it" in capfd.readouterr().err


def test_a_rank_whose_builder_dies_while_it_waits_builds_the_op_itself(
    ext: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Waiting on a live builder for 6 s is not a hang (``hang_timeout=3``); its death is not
    a failure: the rank removes the lock and builds."""
    lock = ext / OP / "lock"
    lock.parent.mkdir()
    holder = hold_lock(lock)
    killer = threading.Timer(6.0, holder.kill)
    killer.start()
    try:
        source = str(ext.parent / "tiny.cpp")
        result = launch(
            tiny_op, (source,), num_processes=1, use_gpu=False, hang_timeout=3.0, timeout=60,
            env=env_for(ext),
        )  # fmt: skip
    finally:
        killer.cancel()
        holder.kill()
        holder.wait()
    assert result.value == str(ext / OP / f"{OP}.so")
    assert f"the build of '{OP}' that this rank waited for did not finish" in capfd.readouterr().err


def test_a_lock_no_process_holds_is_named_in_the_hang_report(ext: Path) -> None:
    """A lock made outside sparktrain and held by no process may be another machine's build:
    it is not removed, and the hang report names it with the way out."""
    lock = ext / OP / "lock"
    lock.parent.mkdir()
    lock.touch()  # what torch's own builder leaves when it is killed
    source = str(ext.parent / "tiny.cpp")
    with pytest.raises(HangError) as raised:
        launch(
            tiny_op, (source,), num_processes=2, use_gpu=False, hang_timeout=6.0, timeout=60,
            env=env_for(ext),
        )  # fmt: skip
    message = str(raised.value)
    assert f"rm {lock}" in message and "held by no process on this host" in message, message
    assert all(str(lock) in site.note for site in raised.value.sites.values())
    assert sorted(raised.value.sites) == [0, 1]
    lock.unlink()  # the way out the report names
    path = launch(tiny_op, (source,), num_processes=1, use_gpu=False, timeout=60, env=env_for(ext))
    assert path.value == str(ext / OP / f"{OP}.so")


def test_lock_states(tmp_path: Path) -> None:
    lock = tmp_path / "op" / "lock"
    lock.parent.mkdir()
    assert buildlock.state(str(lock)).kind == "free"
    fd = buildlock.create(str(lock))
    assert fd is not None and buildlock.create(str(lock)) is None
    assert buildlock.state(str(lock)).kind == "building"
    assert not buildlock.clear_stale(str(lock))  # a live builder's lock stays
    buildlock.release(str(lock), fd)
    assert not lock.exists()
    lock.touch()
    with open(lock) as held:  # a foreign builder: no mark, open in a live process
        found = buildlock.state(str(lock))
        assert found.kind == "foreign" and os.getpid() in found.holders
    assert buildlock.state(str(lock)).kind == "orphan"
    assert not buildlock.clear_stale(str(lock)) and lock.exists()  # never removed behind a back
    assert [s.path for s in buildlock.locks_under(str(tmp_path))] == [str(lock)]
    assert buildlock.clear_orphan(str(lock)) and not lock.exists()  # asked for explicitly
    del held


def test_no_dns_while_a_store_is_made() -> None:
    """Inside ``no_dns``, names come from /etc/hosts only; outside, lookups are as before."""
    import socket

    def lookup(name: str) -> str:
        try:
            return socket.gethostbyname(name)
        except OSError as exc:
            return type(exc).__name__

    before = lookup("sparktrain-no-such-host.example")
    with stores.no_dns("127.0.0.1"):
        assert lookup("localhost") == "127.0.0.1"  # /etc/hosts still answers
        assert lookup("sparktrain-no-such-host.example") == "gaierror"
        assert socket.getnameinfo(("::ffff:127.0.0.1", 80, 0, 0), 0)[0] == "::ffff:127.0.0.1"
    assert lookup("sparktrain-no-such-host.example") == before
    assert not stores.numeric("localhost") and stores.numeric("::1")


def stores_in_rank() -> list[bool]:
    """In a rank: whether every store torch and sparktrain make goes through ``no_dns``."""
    import importlib

    import torch.distributed as dist

    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    dist.init_process_group("gloo")
    return [getattr(rendezvous._create_c10d_store, "sparktrain", False), dist.is_initialized()]


def test_ranks_make_their_stores_without_dns() -> None:
    result = launch(stores_in_rank, num_processes=2, use_gpu=False, timeout=60, return_all=True)
    assert dict(result.return_values) == {0: [True, True], 1: [True, True]}


DEEPSPEED_CALLER = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, even under nohup
sys.path.insert(0, {benchmarks!r})
import stress_patterns
from sparktrain import launch
launch(stress_patterns.deepspeed_engine, num_processes=2, use_gpu=False)
"""


def _compiling(root: int) -> bool:
    """Whether a compiler runs under process ``root`` (the build has begun, not just its lock)."""
    from sparktrain.ground import procfs

    for pid in procfs.descendants(root):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name in {"cc1plus", "c++", "g++", "gcc", "ninja", "ld"}:
            return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a whole C++ build on 2 cores another job also loads
def test_deepspeed_build_stopped_by_ctrl_c_does_not_block_the_next_launch(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The issue's case on a new machine: an empty extension folder, Ctrl-C during DeepSpeed's
    first build, then a launch with a ``hang_timeout`` shorter than the build it has to redo."""
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import stress_patterns

    ext = tmp_path / "ext"
    lock = ext / "deepspeed_shm_comm" / "lock"
    said = tmp_path / "caller.txt"
    with said.open("w") as out:
        caller = subprocess.Popen(
            [sys.executable, "-c", DEEPSPEED_CALLER.format(benchmarks=str(ROOT / "benchmarks"))],
            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 180
    while not (buildlock.state(str(lock)).kind == "building" and _compiling(caller.pid)):
        assert caller.poll() is None, f"the caller ended before the build:\n{said.read_text()}"
        assert time.monotonic() < deadline, f"the build never started:\n{said.read_text()}"
        time.sleep(0.1)
    caller.send_signal(signal.SIGINT)  # Ctrl-C while the compiler runs
    assert caller.wait(60) != 0, said.read_text()
    assert wait_gone([caller.pid]) == [] and not alive(caller.pid)
    assert buildlock.state(str(lock)).kind == "stale"  # what the runs waited on forever
    capfd.readouterr()
    result = launch(
        stress_patterns.deepspeed_engine, num_processes=2, use_gpu=False, hang_timeout=5.0,
        timeout=900, env={"TORCH_EXTENSIONS_DIR": str(ext)},
    )  # fmt: skip
    assert result.value == stress_patterns.VALUE
    err = capfd.readouterr().err
    assert "was stopped and left it" in err and "building the C++ op 'deepspeed_shm_comm'" in err
    assert (ext / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").exists()
