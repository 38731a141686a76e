"""Listen addresses: llama-server's ``--host`` list, bound the way it binds them.

``--host`` takes a comma-separated list (llama.cpp's CSV rule: a field may be quoted, ``""`` is a
quote; fields are stripped and empty ones dropped; at least one must remain). Each entry is an
IP address or host name, or a UNIX socket path ending in ``.sock``; every entry gets its own
listening socket on the same ``--port``. As in llama-server:

- with more than one TCP address, IPv6 sockets are IPv6-only, so ``0.0.0.0,::`` binds both
  families instead of ``::`` also claiming the IPv4 port;
- ``--port 0`` (any free port) is refused with more than one TCP address;
- an address that cannot be bound stops start-up, naming it.

The sockets are opened here and handed to hypercorn as ``fd://`` binds, because hypercorn's own
binding sets no ``IPV6_V6ONLY``. ``--reuse-port`` sets ``SO_REUSEPORT`` on the TCP sockets before
they bind (llama-server's option), so that several servers may share one port; the kernel then
spreads new connections over them. With ``--ssl-*`` the listeners are named ``https://``.
"""

from __future__ import annotations

import csv
import os
import socket
import stat
from dataclasses import dataclass

SOCK_SUFFIX = ".sock"


class ListenError(RuntimeError):
    """The addresses cannot be served (start-up fails with this message)."""


def parse_hosts(value: str) -> list[str]:
    """The ``--host`` entries; ``ValueError`` when none is left."""
    row = next(csv.reader([value], skipinitialspace=False), [])
    hosts = [field.strip() for field in row if field.strip()]
    if not hosts:
        raise ValueError("--host requires at least one address")
    return hosts


def is_unix(host: str) -> bool:
    return host.endswith(SOCK_SUFFIX)


def url_of(host: str, port: int, tls: bool = False) -> str:
    """How llama-server names a listener in its log (IPv6 literals in brackets)."""
    if is_unix(host):
        return f"unix://{host}"
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


@dataclass
class Listeners:
    """Bound, not yet listening sockets (hypercorn calls ``listen``), one per ``--host`` entry."""

    hosts: list[str]
    port: int  # the TCP port they share (the bound one when ``--port 0`` was given)
    sockets: list[socket.socket]
    tls: bool = False

    @property
    def urls(self) -> list[str]:
        return [url_of(host, self.port, self.tls) for host in self.hosts]

    def hand_over(self) -> list[str]:
        """hypercorn ``bind`` strings; the file descriptors are hypercorn's from now on."""
        binds = [f"fd://{sock.detach()}" for sock in self.sockets]
        self.sockets = []
        return binds

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets = []


def open_listeners(hosts: list[str], port: int, reuse_port: bool = False, tls: bool = False) -> Listeners:
    """Bind every entry of ``hosts`` to ``port``; ``ListenError`` (all closed again) on failure.
    ``reuse_port``: ``SO_REUSEPORT`` on the TCP sockets; ``tls``: only names them ``https://``."""
    n_tcp = sum(1 for host in hosts if not is_unix(host))
    if port == 0 and n_tcp > 1:
        raise ListenError("--port 0 is not supported with multiple TCP addresses")
    if reuse_port and not hasattr(socket, "SO_REUSEPORT"):
        raise ListenError("--reuse-port: SO_REUSEPORT is not supported on this platform")
    listeners = Listeners(hosts=list(hosts), port=port, sockets=[], tls=tls)
    for host in hosts:
        try:
            sock = (_bind_unix(host) if is_unix(host)
                    else _bind_tcp(host, listeners.port, v6only=n_tcp > 1, reuse_port=reuse_port))
        except OSError as exc:
            listeners.close()
            raise ListenError(f"couldn't bind HTTP server socket, hostname: {host}, port: {listeners.port} ({exc.strerror or exc})") from exc
        if not is_unix(host):
            listeners.port = sock.getsockname()[1]
        listeners.sockets.append(sock)
    return listeners


def _bind_tcp(host: str, port: int, v6only: bool, reuse_port: bool = False) -> socket.socket:
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if family == socket.AF_INET6 and v6only:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _bind_unix(path: str) -> socket.socket:
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.remove(path)  # a stale socket of an earlier run
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


__all__ = ["ListenError", "Listeners", "open_listeners", "parse_hosts", "url_of"]
