"""Where batchery's HTTP servers (the dashboard, the gateway) listen: whether an address
is this machine only, and whether a port is free before anything starts."""

from __future__ import annotations

import ipaddress
import socket

from batchery.errors import ConfigError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    """True when ``host`` is this machine only (a name, or an IPv4/IPv6 loopback address)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_port_free(host: str, port: int) -> None:
    """Raise ConfigError, saying what to do, unless ``host:port`` can be listened on now:
    a server refuses to start rather than fail after loading everything."""
    if not 0 < port < 65536:
        raise ConfigError(f"--port must be 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} does not resolve ({exc.strerror}); give an "
                          "address of this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another "
                              "--port, or stop what uses it") from None
