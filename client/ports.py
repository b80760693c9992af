"""Loopback ports for processes this one starts (daemons, etcd, S3, stores): handed out
once each per process, chosen together so a call never gets one twice.
"""

from __future__ import annotations

import socket

_handed_out: set[int] = set()  # ports free_ports gave out in this process


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports, none of them given out before by this process.

    They are chosen with their sockets held open together, so the kernel cannot give one
    twice in a call, and a port given out earlier is never given again: its listener may
    not have bound it yet (a daemon still starting), and a free port then looks free. A
    process elsewhere may still take one before its listener binds it: `start_daemons`
    sees that and starts again on other ports."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            if len(held) >= 4096:
                raise OSError(f"found only {len(ports)} of {n} free loopback ports")
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in _handed_out:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    _handed_out.update(ports)
    return ports


def free_port() -> int:
    return free_ports(1)[0]


def port_taken(port: int) -> bool:
    """Whether something on this host listens on (or holds) loopback `port`."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False
