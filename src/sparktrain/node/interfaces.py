"""On a node: the network interface that holds its address, for gloo and NCCL to bind to.

A node has one address: the one by which the other nodes reach it, which sparktrain already uses
for the rendezvous (``MASTER_ADDR``) and for the driver's channel. gloo and NCCL choose their own
device otherwise: gloo binds to the address its host name resolves to, which on many hosts is
``127.0.0.1`` or ``127.0.1.1`` (Debian and Ubuntu map the host name there), so a run across
hosts fails with ``Connection refused, remote=[127.0.0.1]`` while each node's own view looks
fine. So, unless the user set them, each rank gets ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` naming the interface that holds its node's address.

Interfaces and their addresses are read from the kernel without any lookup: IPv4 through the
``SIOCGIFADDR`` ioctl, IPv6 from ``/proc/net/if_inet6``. A loopback address is the loopback
interface's. An address that no interface holds (a NAT'd or proxied address) sets nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping

#: The variables that pick gloo's and NCCL's network interface.
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_LOOPBACK = 0x8


def _ipv4_of(sock: socket.socket, name: str) -> str | None:
    try:
        packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    return socket.inet_ntoa(packed[20:24])


def _is_loopback(sock: socket.socket, name: str) -> bool:
    try:
        flags = fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return False
    return bool(struct.unpack("H", flags[16:18])[0] & _IFF_LOOPBACK)


def _ipv6_interfaces() -> dict[ipaddress.IPv6Address, str]:
    found: dict[ipaddress.IPv6Address, str] = {}
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as table:
        for line in table:
            fields = line.split()
            if len(fields) >= 6:
                with contextlib.suppress(ValueError):
                    found[ipaddress.IPv6Address(int(fields[0], 16))] = fields[5]
    return found


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address``, or ``None``.

    A host name (a Spark executor may be known by one) is resolved first; the first of its
    addresses that an interface holds counts.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return next(filter(None, map(interface_of, _addresses_of(address))), None)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        else:
            if ip.is_loopback:
                return _loopback()
            return _ipv6_interfaces().get(ip)
    if ip.is_loopback:
        return _loopback()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            if _ipv4_of(probe, name) == str(ip):
                return name
    return None


def _addresses_of(host: str) -> list[str]:
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in found))


def _loopback() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            if _is_loopback(probe, name):
                return name
    return None


def ifname_environ(address: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for a node at ``address``.

    Only the variables that ``environ`` (the ranks' environment before the contract) does not
    set already; none when no interface holds the address.
    """
    missing = [name for name in IFNAME_VARIABLES if not environ.get(name)]
    if not missing:
        return {}
    interface = interface_of(address)
    return {name: interface for name in missing} if interface else {}
