"""Hosts with their own addresses on this machine: a Linux bridge and one network namespace each.

The driver's host is the bridge (``x.x.x.1``), and each worker host a namespace joined to it by a
veth pair whose inner end is ``eth1`` (``x.x.x.2``, ``x.x.x.3``...). The host name is the
machine's in every namespace, and resolves as it does here (to loopback on this project's
machines, as on many real hosts), so gloo's default device would bind to loopback: the trap that
runs across hosts fall into. Processes started with :meth:`Hosts.run` live in a namespace;
:meth:`Hosts.partition` cuts a host off (its link goes down, its processes keep running).

Needs root and iproute2; :func:`available` says why not otherwise. Every name carries a random
tag and the subnet is random in ``10.231-254.x.0/24``, so that two runs on one machine never meet.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


def available() -> str | None:
    """Why namespace hosts cannot be made here, or ``None`` when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    tag = f"stprobe{random.randrange(1 << 20):x}"
    made = subprocess.run(["ip", "netns", "add", tag], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", tag], capture_output=True, check=False)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


class Hosts:
    """A bridge (the driver's host) and ``count`` namespace hosts on it."""

    def __init__(self, count: int = 2) -> None:
        """Make them; everything is removed by :meth:`close` (or on a failure here)."""
        tag = f"{random.randrange(1 << 16):04x}"
        self.subnet = f"10.{random.randrange(231, 255)}.{random.randrange(256)}"
        self.bridge = f"stbr{tag}"
        self.driver = f"{self.subnet}.1"
        self.names = [f"st{tag}h{i}" for i in range(count)]
        self.links = [f"stv{tag}{i}" for i in range(count)]
        self.addresses = [f"{self.subnet}.{i + 2}" for i in range(count)]
        self.processes: list[subprocess.Popen[bytes]] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.driver}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name, link, address in zip(self.names, self.links, self.addresses, strict=True):
                _ip("netns", "add", name)
                _ip("link", "add", link, "type", "veth", "peer", "name", "eth1", "netns", name)
                _ip("link", "set", link, "master", self.bridge)
                _ip("link", "set", link, "up")
                _ip("addr", "add", f"{address}/24", "dev", "eth1", netns=name)
                _ip("link", "set", "eth1", "up", netns=name)
                _ip("link", "set", "lo", "up", netns=name)
        except BaseException:
            self.close()
            raise

    def run(
        self, host: int, command: Sequence[str], *, log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``command`` on host ``host`` (in its namespace, a process group of its own)."""
        with log.open("ab") as out:
            process = subprocess.Popen(
                ["ip", "netns", "exec", self.names[host], *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def start(
        self, command: Sequence[str], *, log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``command`` on the driver's host (this namespace), in a group of its own."""
        with log.open("ab") as out:
            process = subprocess.Popen(
                list(command), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.processes.append(process)
        return process

    def pids(self, host: int) -> list[int]:
        """The processes running on host ``host``."""
        found = subprocess.run(
            ["ip", "netns", "pids", self.names[host]], capture_output=True, text=True, check=False
        )
        return [int(p) for p in found.stdout.split()]

    def partition(self, host: int) -> None:
        """Cut host ``host`` off: its link goes down; its processes keep running."""
        _ip("link", "set", self.links[host], "down")

    def heal(self, host: int) -> None:
        """Bring host ``host``'s link back."""
        _ip("link", "set", self.links[host], "up")

    def close(self) -> None:
        """Kill every process started here and on the hosts; remove the namespaces and bridge."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for name in self.names:
            for pid in self.pids(self.names.index(name)) if name in self._namespaces() else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for process in self.processes:
            with contextlib.suppress(Exception):
                process.wait(10)
        for name in self._namespaces():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    def _namespaces(self) -> list[str]:
        found = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
        listed = {line.split()[0] for line in found.stdout.splitlines() if line.strip()}
        return [name for name in self.names if name in listed]

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for_port(address: str, port: int, *, within: float = 120.0) -> None:
    """Wait until something accepts connections at ``address:port``."""
    deadline = time.monotonic() + within
    while True:
        with socket.socket() as probe:
            probe.settimeout(1.0)
            if probe.connect_ex((address, port)) == 0:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens at {address}:{port} after {within:g}s")
        time.sleep(0.3)


@contextlib.contextmanager
def hosts(count: int = 2) -> Iterator[Hosts]:
    """:class:`Hosts`, closed at the end."""
    made = Hosts(count)
    try:
        yield made
    finally:
        made.close()
