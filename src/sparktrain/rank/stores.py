"""Inside a rank: the run's TCPStore, reached without asking DNS.

Every ``torch.distributed.TCPStore`` client (torch 2.13) looks its server's numeric address up
as an IPv6 address first, so ``127.0.0.1`` becomes ``::ffff:127.0.0.1``, and names the socket
for its logs with ``getnameinfo``: a reverse lookup that ``/etc/hosts`` cannot answer for such an
address, so glibc asks DNS. A lost reply costs the resolver's whole timeout (5 s by default); on
this project's machines about one lookup in fifty waited so, which made one launch in a few
hundred take 5 s, and a ``hang_timeout`` under that could call it a hang.

:func:`no_dns` has glibc answer host lookups from ``/etc/hosts`` alone while a store is made
(``__nss_configure_lookup``), then puts back the machine's own setting (the ``hosts:`` line of
``/etc/nsswitch.conf``). The name is only for a log line and the address is numeric, so nothing
is lost. The switch is process-wide while it lasts (the milliseconds of a connect), applies only
to numeric addresses, and does nothing where glibc is not the C library. Every store a rank
makes goes through it: the one rank 0 hosts (:func:`host_store`), sparktrain's own clients
(:func:`client_store`), and torch's own, made by ``init_process_group`` for ``env://`` and
``tcp://`` (:func:`install` wraps ``torch.distributed.rendezvous._create_c10d_store``).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import importlib
import ipaddress
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

_NSSWITCH = "/etc/nsswitch.conf"
_lock = threading.RLock()


def _hosts_line() -> bytes:
    """The ``hosts:`` services of ``/etc/nsswitch.conf`` (glibc's default when it has none)."""
    try:
        with open(_NSSWITCH, "rb") as conf:
            for line in conf:
                key, _, services = line.partition(b"#")[0].partition(b":")
                if key.strip() == b"hosts" and services.strip():
                    return b" ".join(services.split())
    except OSError:
        pass
    return b"files dns"


@functools.cache
def _configure() -> Any:
    """The C library's ``__nss_configure_lookup``, or ``None`` where it is not glibc's."""
    try:
        configure = ctypes.CDLL(None).__nss_configure_lookup
    except (OSError, AttributeError):
        return None
    configure.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    configure.restype = ctypes.c_int
    return configure


def numeric(host: str) -> bool:
    """Whether ``host`` is an IP address rather than a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def no_dns(host: str) -> Iterator[None]:
    """While the block runs, host lookups in this process use ``/etc/hosts`` only.

    Does nothing when ``host`` is a name (it may need DNS) or glibc cannot be told.
    """
    configure = _configure() if numeric(host) else None
    if configure is None:
        yield
        return
    with _lock:
        configure(b"hosts", b"files")
        try:
            yield
        finally:
            configure(b"hosts", _hosts_line())


def host_store(listen_fd: int, host: str, port: int, world_size: int, timeout: float) -> Any:
    """Rank 0's server of the run's store, on the socket its node bound (the port never raced)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    listener = socket.socket(fileno=listen_fd)
    with no_dns(host):
        return TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )


def client_store(host: str, port: int, timeout: float) -> Any:
    """A client of the store at ``host:port``."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    with no_dns(host):
        return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def contract_store(timeout_s: float = 600) -> Any:
    """A client of the run's store (``MASTER_ADDR:MASTER_PORT`` of the rank's contract)."""
    from sparktrain.contract.env import contract_store_address

    return client_store(*contract_store_address(), timeout_s)


def install() -> None:
    """Make the stores that ``init_process_group`` creates without DNS too (once per rank)."""
    if "torch.distributed" not in sys.modules:  # a rank that never imports torch needs nothing
        return
    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the function shadows it
    original = getattr(rendezvous, "_create_c10d_store", None)
    if original is None or getattr(original, "sparktrain", False):
        return

    @functools.wraps(original)
    def _create_c10d_store(*args: Any, **kwargs: Any) -> Any:
        with no_dns(str(kwargs.get("hostname", args[0] if args else ""))):
            return original(*args, **kwargs)

    _create_c10d_store.sparktrain = True  # type: ignore[attr-defined]
    setattr(rendezvous, "_create_c10d_store", _create_c10d_store)  # noqa: B010 - private
