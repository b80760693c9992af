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


# Which process holds a connection to a Unix socket path: gRPC hides the peer's
# SO_PEERCRED, so a registering rank's pid is checked against the kernel's socket table
# (sock_diag netlink: each accepted socket of `path` and the inode of its client end).

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_DUMP_REQUEST = 0x301
_NLMSG_DONE, _NLMSG_ERROR = 3, 2
_UDIAG_SHOW_NAME, _UDIAG_SHOW_PEER = 1, 4
_UNIX_DIAG_NAME, _UNIX_DIAG_PEER = 0, 2
_NLMSG = struct.Struct("=IHHII")
_DIAG_MSG = struct.Struct("=BBBBIII")
_RTATTR = struct.Struct("=HH")


def _client_inodes(path: str) -> set[int]:
    """Inodes of the client ends of every connection accepted on the socket at `path`."""
    request = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0,
                          _UDIAG_SHOW_NAME | _UDIAG_SHOW_PEER, 0xFFFFFFFF, 0xFFFFFFFF)
    want = os.fsencode(path)
    found: set[int] = set()
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.send(_NLMSG.pack(_NLMSG.size + len(request), _SOCK_DIAG_BY_FAMILY,
                            _NLM_F_DUMP_REQUEST, 1, 0) + request)
        while True:
            data = nl.recv(1 << 16)
            offset = 0
            while offset + _NLMSG.size <= len(data):
                length, kind = _NLMSG.unpack_from(data, offset)[:2]
                if kind in (_NLMSG_DONE, _NLMSG_ERROR) or length < _NLMSG.size:
                    return found
                name, peer = _attributes(data, offset + _NLMSG.size + _DIAG_MSG.size,
                                         offset + length)
                if peer and name == want:
                    found.add(peer)
                offset += (length + 3) & ~3


def _attributes(data: bytes, start: int, end: int) -> tuple[bytes, int]:
    name, peer = b"", 0
    while start + _RTATTR.size <= end:
        length, kind = _RTATTR.unpack_from(data, start)
        if length < _RTATTR.size:
            break
        payload = data[start + _RTATTR.size:start + length]
        if kind == _UNIX_DIAG_NAME:
            name = payload.rstrip(b"\0")
        elif kind == _UNIX_DIAG_PEER and len(payload) >= 4:
            peer = struct.unpack_from("=I", payload)[0]
        start += (length + 3) & ~3
    return name, peer


def _socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` has open (empty when /proc will not say)."""
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    except OSError:
        pass
    return out


def connected_to(pid: int, path: str) -> bool:
    """True when process `pid` holds a connection to the Unix socket listening at `path`
    (so a rank cannot register another process, the daemon's or another user's, as itself:
    those hold no connection to the socket)."""
    if pid <= 0:
        return False
    mine = _socket_inodes(pid)
    try:
        return bool(mine and mine & _client_inodes(path))
    except OSError:
        return False


def cred_of(pid: int) -> PeerCred | None:
    """The real uid and gid of a running process, None when it is gone."""
    ids: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("Uid:", "Gid:")):
                    ids[line[:3]] = int(line.split()[1])
    except (OSError, ValueError):
        return None
    return PeerCred(pid, ids.get("Uid", -1), ids.get("Gid", -1)) if len(ids) == 2 else None


def connected_pids(path: str) -> list[int]:
    """Pids (as this daemon sees them) of the processes holding a connection to the
    socket at `path`; processes in a pid namespace the daemon cannot see are missing."""
    try:
        clients = _client_inodes(path)
    except OSError:
        return []
    if not clients:
        return []
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _socket_inodes(int(e)) & clients]


def inner_pid(pid: int) -> int:
    """The pid process `pid` has in its own (innermost) pid namespace, from NSpid."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return pid
