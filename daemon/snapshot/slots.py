"""Daemon-owned shared-memory slots that ranks copy their state into.

A slot is a memfd (anonymous, never on a filesystem, so no process that only
attached can delete it), sized once, pre-faulted so the rank's first copy does
not pay for page faults, and reused for every later capture. Ranks receive the
file descriptor over a Unix socket (SCM_RIGHTS); the daemon keeps its own
mapping, so a captured state outlives the rank that wrote it.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.daemon.errors import DaemonError, Exhausted, Invalid, NotFound
from stalwart.daemon.security.peercred import peer_cred, refusal

log = logging.getLogger(__name__)

PREFAULT_BLOCK = 64 << 20  # bytes touched per write while pre-faulting
MAX_REQUEST = 256          # bytes: "<slot_id> <token>\n"
MAX_FD_CONNECTIONS = 64    # slot requests served at once
FD_REQUEST_DEADLINE_S = 1.0  # a caller gets this long to send its request (seconds)
ONCE_TTL_S = 60.0  # a restore's slot not fetched by then is dropped at the next restore


class SlotError(DaemonError):
    """A slot request that cannot be served."""


class UnknownSlot(SlotError, NotFound):
    pass


class SlotBudgetExceeded(SlotError, Exhausted):
    pass


class BadSlotSize(SlotError, Invalid):
    pass


@dataclass
class Slot:
    slot_id: str
    rank_id: str
    size: int  # bytes
    fd: int
    view: mmap.mmap
    busy: bool = False  # True from Capture until the daemon has consumed it
    released: threading.Event = field(default_factory=threading.Event)
    once: bool = False  # a restore's slot: handed out once, then the rank's alone
    created: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        self.view.close()
        os.close(self.fd)


def _prefault(view: mmap.mmap) -> None:
    """Touch every page now so the first capture copies at memory speed."""
    zeros = bytes(min(PREFAULT_BLOCK, len(view)))
    for start in range(0, len(view), PREFAULT_BLOCK):
        end = min(start + PREFAULT_BLOCK, len(view))
        view[start:end] = zeros[: end - start]


class SlotPool:
    """Slots by id, within a byte budget for all ranks of this node."""

    def __init__(self, budget_bytes: int, token: str = "") -> None:
        self.budget_bytes = budget_bytes
        self.token = token
        self._slots: dict[str, Slot] = {}
        self._reserved = 0  # bytes of one-time slots being made
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._slots.values())

    def open(self, rank_id: str, nbytes: int, count: int = 2) -> list[Slot]:
        """Return `count` slots of at least nbytes for rank_id, reusing what fits.

        Two slots per rank let the daemon encode step s while the rank copies
        step s+1.
        """
        if nbytes <= 0:
            raise BadSlotSize(f"slot size must be positive, got {nbytes} bytes")
        size = mmap.PAGESIZE * -(-nbytes // mmap.PAGESIZE)
        with self._lock:
            mine = [s for s in self._slots.values() if s.rank_id == rank_id and not s.once]
            if len(mine) == count and all(s.size >= size for s in mine):
                return mine
            others = sum(s.size for s in self._slots.values() if s not in mine) + \
                self._reserved
            if others + count * size > self.budget_bytes:
                raise SlotBudgetExceeded(
                    f"shared-memory budget exceeded: rank {rank_id} needs {count} x {size} bytes "
                    f"but only {self.budget_bytes - others} of {self.budget_bytes} are free; "
                    "raise [snapshot] slot_bytes or the memory of /dev/shm")
            for s in mine:
                del self._slots[s.slot_id]
                s.close()
        fresh = [self._create(rank_id, size) for _ in range(count)]
        with self._lock:
            for s in fresh:
                self._slots[s.slot_id] = s
        return fresh

    def open_once(self, rank_id: str, nbytes: int) -> Slot:
        """A slot for one restore of `rank_id`: the FdServer hands it out once and then
        forgets it (the rank's mapping keeps the memory). An earlier one the rank never
        fetched, and any not fetched within ONCE_TTL_S, are dropped first."""
        if nbytes <= 0:
            raise BadSlotSize(f"slot size must be positive, got {nbytes} bytes")
        size = mmap.PAGESIZE * -(-nbytes // mmap.PAGESIZE)
        now = time.monotonic()
        with self._lock:
            stale = [s for s in self._slots.values() if s.once and (
                s.rank_id == rank_id or now - s.created > ONCE_TTL_S)]
            for s in stale:
                del self._slots[s.slot_id]
            used = sum(s.size for s in self._slots.values()) + self._reserved
            if used + size > self.budget_bytes:
                raise SlotBudgetExceeded(f"no room for a {size}-byte restore slot: {used} of "
                                         f"{self.budget_bytes} bytes are in use")
            self._reserved += size
        for s in stale:
            s.close()
        try:
            slot = self._create(rank_id, size, prefault=False)  # the restore writes it all
        finally:
            with self._lock:
                self._reserved -= size
        slot.once = True
        with self._lock:
            self._slots[slot.slot_id] = slot
        return slot

    def forget(self, slot_id: str) -> None:
        """Drop a one-time slot its rank will not fetch (its restore reply was lost)."""
        with self._lock:
            slot = self._slots.get(slot_id)
            if slot is None or not slot.once:
                return
            del self._slots[slot_id]
        slot.close()

    def take_fd(self, slot_id: str) -> tuple[Slot, int]:
        """The slot and a descriptor of it that the caller sends and then closes: a
        duplicate for a reusable slot, the slot's own for a one-time slot, which leaves
        the pool here, so that it is handed out once even to callers side by side."""
        with self._lock:
            slot = self._slots.get(slot_id)
            if slot is None:
                raise UnknownSlot(f"unknown slot {slot_id!r}; ask for a new one with OpenSlot")
            if not slot.once:
                return slot, os.dup(slot.fd)
            del self._slots[slot_id]
        slot.view.close()  # the descriptor, sent and closed by the caller, is all that's left
        return slot, slot.fd

    def _create(self, rank_id: str, size: int, prefault: bool = True) -> Slot:
        fd = os.memfd_create(f"stalwart-{rank_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            view = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            raise
        if prefault:
            _prefault(view)
        slot = Slot(slot_id=secrets.token_hex(8), rank_id=rank_id, size=size, fd=fd, view=view)
        slot.released.set()
        return slot

    def get(self, slot_id: str) -> Slot:
        with self._lock:
            slot = self._slots.get(slot_id)
        if slot is None:
            raise UnknownSlot(f"unknown slot {slot_id!r}; ask for a new one with OpenSlot")
        return slot

    def drop_rank(self, rank_id: str) -> None:
        """Free a departed rank's slots (its last capture must be consumed first)."""
        with self._lock:
            gone = [s for s in self._slots.values() if s.rank_id == rank_id]
            for s in gone:
                del self._slots[s.slot_id]
        for s in gone:
            s.close()

    def close(self) -> None:
        with self._lock:
            slots, self._slots = list(self._slots.values()), {}
        for s in slots:
            s.close()


class FdServer:
    """Hands a slot's fd to a local process that names the slot (and the token).

    The caller must pass the uid check of peercred.refusal and, in a daemon
    (`owner_check` set), be the very process that registered as the slot's rank: a slot
    holds the model's state. Connections are served side by side, each with a short
    deadline, so idle or slow callers cannot hold up a rank's slot.
    """

    def __init__(self, pool: SlotPool, path: Path, metrics: Any = None,
                 owner_check: Callable[[str, int], str] | None = None) -> None:
        self.pool = pool
        self.path = path
        self.metrics = metrics  # stalwart.daemon.metrics.Metrics: counts refused callers
        # (rank_id, the caller's pid by SO_PEERCRED) -> why it may not have the slot, or "".
        self.owner_check = owner_check
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._open = threading.BoundedSemaphore(MAX_FD_CONNECTIONS)

    def start(self) -> None:
        self.path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.path))
        os.chmod(self.path, 0o660)  # ranks may run as another user in the daemon's group
        sock.listen(64)
        sock.settimeout(0.2)  # lets the loop notice stop() promptly
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="stalwart-fd-server",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._open.acquire(blocking=False):
                with conn:
                    self._refused(conn, "busy", f"{MAX_FD_CONNECTIONS} slot requests are "
                                  "already open; retry")
                continue
            threading.Thread(target=self._one, args=(conn,), name="stalwart-fd-request",
                             daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(FD_REQUEST_DEADLINE_S)
                self._answer(conn)
        except (OSError, ValueError) as exc:
            log.warning("fd request failed: %s", exc)
        finally:
            self._open.release()

    def _refused(self, conn: socket.socket, reason: str, message: str) -> None:
        if self.metrics is not None:
            self.metrics.auth_refused.labels(reason).inc()
        log.warning("fd request refused: %s", message)
        conn.sendall(f"ERR {message}\n".encode())

    def _answer(self, conn: socket.socket) -> None:
        cred = peer_cred(conn)
        why = refusal(cred)
        if why:
            self._refused(conn, "uid", why)
            return
        request = conn.recv(MAX_REQUEST).decode("ascii", "replace").split()
        if len(request) not in (1, 2):
            conn.sendall(b"ERR malformed request; send '<slot_id> [token]'\n")
            return
        slot_id, token = request[0], (request[1] if len(request) == 2 else "")
        if self.pool.token and not secrets.compare_digest(token.encode(), self.pool.token.encode()):
            self._refused(conn, "token", "wrong or missing job token; set STALWART_TOKEN")
            return
        try:
            slot = self.pool.get(slot_id)
        except SlotError as exc:
            conn.sendall(f"ERR {exc}\n".encode())
            return
        why = "" if self.owner_check is None else self.owner_check(slot.rank_id, cred.pid)
        if why:
            self._refused(conn, "pid", f"slot {slot_id} belongs to rank {slot.rank_id}; {why}")
            return
        try:
            slot, fd = self.pool.take_fd(slot_id)
        except SlotError as exc:  # dropped, or handed out to a caller beside this one
            conn.sendall(f"ERR {exc}\n".encode())
            return
        try:
            socket.send_fds(conn, [f"OK {slot.size}\n".encode()], [fd])
        finally:
            os.close(fd)

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._sock is not None:  # only the socket this server bound
            self.path.unlink(missing_ok=True)
            self._sock = None
