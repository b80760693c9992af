"""Who is on the other end of a Unix socket: the kernel's SO_PEERCRED (pid, uid, gid).

Local ranks are admitted when they run as the daemon's user, as root, or in the
daemon's group (the deployment adds the ranks to it); anyone else is refused.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """The credentials the kernel recorded when the peer connected (not spoofable)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCred(*_UCRED.unpack(raw))


def _groups_of(pid: int) -> set[int]:
    """Supplementary groups of a process (empty when it is gone or in another pid namespace)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def refusal(cred: PeerCred, uid: int | None = None, gid: int | None = None) -> str:
    """Why a peer may not use this daemon, or "" when it may.

    Allowed: root, the daemon's uid, its primary gid, or a process that has the
    daemon's gid among its supplementary groups.
    """
    uid = os.getuid() if uid is None else uid
    gid = os.getgid() if gid is None else gid
    if cred.uid in (0, uid) or cred.gid == gid:
        return ""
    if cred.pid > 0 and gid in _groups_of(cred.pid):
        return ""
    return (f"process {cred.pid} runs as uid {cred.uid} gid {cred.gid}, which is neither the "
            f"daemon's user ({uid}) nor in its group ({gid}); run the ranks as that user or "
            "add them to that group")
