"""Helpers shared by the benchmark scripts: progress lines, formatting, the leftover check.

Every process a benchmark starts inherits ``BENCH_TAG_VAR`` (JVMs, torchrun, fork servers and
ranks included), so the leftover check counts this run's processes and never anyone else's.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_TAG_VAR = "SPARKTRAIN_BENCH_TAG"


def log(message: str) -> None:
    """Progress line on stderr (the table goes to stdout)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def make_venv(
    venv: Path, installs: list[list[str]], check: str, env: dict[str, str] | None = None
) -> dict[str, str]:
    """Make (or reuse) a rival's venv: ``{"python": ...}``, or ``{"error": ...}`` with pip's text.

    ``installs`` are pip calls in order; a venv whose python runs ``check`` is reused as it is.
    """
    python = venv / "bin" / "python"
    tried = [str(python), "-c", check]
    if python.exists() and subprocess.run(tried, capture_output=True, check=False).returncode == 0:
        return {"python": str(python)}
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for packages in installs:
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *packages],
            check=False,
            capture_output=True,
            text=True,
            env=env,
        )
        if done.returncode != 0:
            return {"error": f"pip install {' '.join(packages)}: {done.stderr.strip()[-800:]}"}
    found = subprocess.run(tried, capture_output=True, text=True, check=False)
    if found.returncode != 0:
        return {"error": found.stderr.strip().splitlines()[-1]}
    return {"python": str(python)}


def version_of(dist_name: str) -> str:
    """Installed version of a distribution, without importing it."""
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def _has_tag(pid: int, tag: bytes) -> bool:
    try:
        return tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def cmdline(pid: int) -> str:
    """The command line of ``pid``, spaces for NULs; ``""`` when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def tagged_processes(exclude: frozenset[int] = frozenset()) -> dict[int, str]:
    """Live processes (other than this one and ``exclude``) that carry this run's tag."""
    tag = f"{BENCH_TAG_VAR}={os.environ.get(BENCH_TAG_VAR, '')}".encode()
    skip = exclude | {os.getpid()}
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in skip:
            pid = int(entry.name)
            if _has_tag(pid, tag):
                cmd = cmdline(pid)
                if cmd:  # zombies have none
                    found[pid] = cmd
    return found


def leftover_processes(
    grace_s: float = 3.0, exclude: frozenset[int] = frozenset()
) -> tuple[dict[int, str], float]:
    """Tagged processes still alive after up to ``grace_s``; and how long it took to be clean."""
    start = time.monotonic()
    while True:
        strays = tagged_processes(exclude)
        waited = time.monotonic() - start
        if not strays or waited >= grace_s:
            return strays, waited
        time.sleep(0.2)


def stop_strays(strays: dict[int, str]) -> None:
    """Terminate, by pid, leftover processes this benchmark started."""
    for pid in strays:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    time.sleep(1.0)
    for pid in strays:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def report_leftovers(grace_s: float = 3.0) -> None:
    """Print this run's processes still alive at its end (and terminate them), or that none are."""
    strays, _ = leftover_processes(grace_s)
    if strays:
        print("WARNING: leftover processes after the benchmark (now terminated):")
        for pid, cmd in sorted(strays.items()):
            print(f"  pid {pid}: {cmd[:160]}")
        stop_strays(strays)
    else:
        print("No leftover processes.")


def print_machine(*packages: str) -> None:
    """The machine block every benchmark prints first: cores, Python, the packages' versions."""
    import platform

    print("Machine")
    print(f"  cpu count : {os.cpu_count()}")
    print(f"  python    : {platform.python_version()} ({sys.executable})")
    for name in (*packages, "sparktrain"):
        print(f"  {name:<10}: {version_of(name)}")
    print(f"  platform  : {platform.platform()}")
    print(f"  load avg  : {load_average()} (1, 5, 15 min; other work on the machine skews timings)")
    print(flush=True)


def resume(ckpt_dir: str, model: Any, optimizer: Any, data: Any) -> int:
    """Inside a rank: load the newest ``sparktrain.checkpoint`` into the model, the optimizer and
    the data reader (saved as ``{"model", "optimizer", "data"}``); its step, 0 when there is none.
    """
    from sparktrain import checkpoint

    latest = checkpoint.load_latest(ckpt_dir)
    if latest is None:
        return 0
    model.load_state_dict(latest.state["model"])
    optimizer.load_state_dict(latest.state["optimizer"])
    data.load_state_dict(latest.state["data"])
    return int(latest.step)


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening(port: int) -> bool:
    """Whether something accepts connections on loopback ``port``."""
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (torchrun's workers run in sessions of their own)."""
    from sparktrain.ground.procfs import parent_of

    parents = {int(e.name): parent_of(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()}
    tree, frontier = [root], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def kill_tree(root: int) -> None:
    """SIGKILL the process groups of ``root`` and its descendants, then each of them."""
    tree = process_tree(root)
    groups = set()
    for pid in tree:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(pid))
    for group in groups:
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
