"""What can go wrong in the daemon's domain objects, by kind, with no gRPC in sight.

Domain code raises these (or `core.generation.StaleGeneration`); the servicers in
`daemon/rpc/` map each kind to one status code (`rpc/errors.py`). Messages say what
happened and what the caller can do.
"""

from __future__ import annotations

import errno


class DaemonError(Exception):
    """Base of the daemon's typed errors."""


class NotFound(DaemonError):
    """The rank, slot, step or shard asked for is not here."""


class Refused(DaemonError):
    """The caller may not do this (another rank's slot, another job)."""


class Exhausted(DaemonError):
    """A bound is reached: shared memory, disk quota, registrations."""


class Invalid(DaemonError):
    """The request contradicts itself or what it refers to."""


class NotReady(DaemonError):
    """The request is fine but the daemon's state does not allow it yet (or any more)."""


class DataLoss(DaemonError):
    """Stored bytes failed their checksum."""


class NotRecoverable(NotReady):
    """A step cannot be rebuilt from the shards that survive; `recoverable_step` is the
    newest step that still can be (None when none can)."""

    def __init__(self, message: str, recoverable_step: int | None) -> None:
        super().__init__(message)
        self.recoverable_step = recoverable_step


def disk_full(exc: BaseException) -> str | None:
    """What a caller is told when `exc` is this node's disk refusing a write (full, or
    over its quota), or None for any other error: a condition of the node, answered
    RESOURCE_EXHAUSTED and logged without a traceback, not a daemon bug."""
    if not isinstance(exc, OSError) or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    where = f" writing {exc.filename}" if exc.filename else ""
    return (f"this node's disk is full ({exc.strerror}{where}); free space in the "
            "daemon's data_dir")
