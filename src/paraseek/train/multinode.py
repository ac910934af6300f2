"""Several nodes: the rendezvous endpoint checked before launch."""

from __future__ import annotations

import ipaddress
import os
import socket

from paraseek.errors import UserError

# "1" allows a loopback rendezvous endpoint with --nnodes > 1: every node's launcher runs on this machine (tests,
# trying a multi-node command on one host). Anywhere else a loopback endpoint cannot be reached by the other nodes.
ONE_HOST_ENV = "PARASEEK_NODES_ON_ONE_HOST"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) -> (host, port)."""
    host, _, port = endpoint.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UserError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT with a port from 1 to 65535, e.g. "
                        "node0:29500")
    return host, int(port)


def check_endpoint(endpoint: str) -> str:
    """The endpoint's address as this node resolves it; refused when it does not resolve, or resolves to a loopback
    address the other nodes cannot reach (unless PARASEEK_NODES_ON_ONE_HOST=1)."""
    host, port = parse_endpoint(endpoint)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"--rdzv-endpoint {endpoint}: {host!r} does not resolve on this node ({e.strerror}); give "
                        "node 0's hostname or IP address") from None
    address = infos[0][4][0]
    if ipaddress.ip_address(address.split("%")[0]).is_loopback and os.environ.get(ONE_HOST_ENV) != "1":
        raise UserError(f"--rdzv-endpoint {endpoint} resolves to the loopback address {address} on this node, which "
                        f"the other nodes cannot reach; give node 0's hostname or IP address ({ONE_HOST_ENV}=1 allows "
                        "it when every node's launcher runs on this one machine)")
    return address


def route_interface(address: str, port: int) -> tuple[str, str]:
    """(interface name, local address) by which this node reaches `address`: the kernel's route, asked by connecting
    a UDP socket (which sends nothing). The name is "" when it cannot be told (IPv6, or no interface holds it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, port))
        local = s.getsockname()[0]
    if family == socket.AF_INET6:
        return "", local
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(packed[20:24]) == local:
                return name, local
    return "", local
