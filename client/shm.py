"""Client side of the slot hand-over: receive a daemon-owned memfd and map it.

The daemon's fd socket answers a line "<slot_id> [token]" with "OK <size>" and
the file descriptor (SCM_RIGHTS), or "ERR <reason>". Mapping the same memfd
makes the rank's copy visible to the daemon without another copy.
"""

from __future__ import annotations

import mmap
import os
import socket
from dataclasses import dataclass
from pathlib import Path

MAX_REPLY = 256  # bytes
MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap module does not name it


class SlotRefused(RuntimeError):
    """The daemon would not hand over the slot (unknown id, wrong token)."""


def receive_fd(path: str | Path, slot_id: str, token: str = "",
               timeout_s: float = 10.0) -> tuple[int, int]:
    """Ask the daemon's fd socket for a slot; return (fd, size in bytes)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        sock.sendall(f"{slot_id} {token}\n".encode())
        msg, fds, _, _ = socket.recv_fds(sock, MAX_REPLY, 1)
    text = msg.decode("ascii", "replace").strip()
    if not text.startswith("OK") or not fds:
        for fd in fds:
            os.close(fd)
        reason = text.removeprefix("ERR ").strip() or "no file descriptor received"
        raise SlotRefused(f"daemon refused slot {slot_id}: {reason}")
    return fds[0], int(text.split()[1])


@dataclass
class MappedSlot:
    """A daemon slot mapped into this process."""

    slot_id: str
    size: int  # bytes
    view: mmap.mmap

    @classmethod
    def attach(cls, fd_socket: str | Path, slot_id: str, token: str = "") -> MappedSlot:
        fd, size = receive_fd(fd_socket, slot_id, token)
        try:
            view = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the memory alive
        return cls(slot_id=slot_id, size=size, view=view)

    def populate(self) -> None:
        """Fault every page of the mapping in now, so the first copy into it does not;
        on a kernel without MADV_POPULATE_WRITE the first copy does, as before."""
        try:
            self.view.madvise(MADV_POPULATE_WRITE)
        except OSError:
            pass

    def close(self) -> None:
        self.view.close()
