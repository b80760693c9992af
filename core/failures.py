"""Typed failure events: what a detector saw, about whom, and the evidence.

Every detector (daemon or client side) produces a `Failure`; the coordinator's
decision code consumes them. They travel as `stalwart.v1.FailureEvent`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from stalwart.v1 import common_pb2

__all__ = ["Failure", "FailureKind"]


RAISED_CHARS = 300
"""The most of a rank's exception text its process-exit failure carries."""
AFTER_RAISING = " after raising "
"""Between a process exit's evidence and the exception the rank exited with."""


class FailureKind(enum.Enum):
    """The detector that fired; values match `FailureEvent.Kind`."""

    HEARTBEAT_MISSED = common_pb2.FailureEvent.HEARTBEAT_MISSED
    PROCESS_EXIT = common_pb2.FailureEvent.PROCESS_EXIT
    COLLECTIVE_HANG = common_pb2.FailureEvent.COLLECTIVE_HANG
    GPU_FAULT = common_pb2.FailureEvent.GPU_FAULT
    PEER_LOST = common_pb2.FailureEvent.PEER_LOST
    STRAGGLER = common_pb2.FailureEvent.STRAGGLER
    STALLED = common_pb2.FailureEvent.STALLED
    STORAGE_FULL = common_pb2.FailureEvent.STORAGE_FULL

    @property
    def is_fact(self) -> bool:
        """True for failures that stay true across generations (a dead process, a lost GPU
        or node); False for observations that only hold inside one generation (a late
        heartbeat, a hung collective, a slow step) and go stale when the plan changes."""
        return self in (FailureKind.PROCESS_EXIT, FailureKind.GPU_FAULT, FailureKind.PEER_LOST)


@dataclass(frozen=True)
class Failure:
    """One detected failure.

    `subject` is a rank_id, or a node name for PEER_LOST. `evidence` is the
    human-readable proof (exit signal, Xid, seconds late); `details` holds the same
    facts as values for code (they do not survive the protobuf round trip).
    """

    kind: FailureKind
    subject: str
    evidence: str
    generation: int = 0
    reporter: str = ""
    time_unix_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    # A rank's newest step its daemon took a capture of before the failure (0: unknown)
    captured_step: int = 0
    details: Mapping[str, str | int | float | bool] = field(default_factory=dict, hash=False)

    @property
    def names_node(self) -> bool:
        """True when `subject` is a node (every rank on it is affected)."""
        return self.kind is FailureKind.PEER_LOST

    @property
    def raised(self) -> str:
        """The exception a rank's training raised before its process exited ("" if none
        was told)."""
        if self.kind is not FailureKind.PROCESS_EXIT or AFTER_RAISING not in self.evidence:
            return ""
        return self.evidence.split(AFTER_RAISING, 1)[1]

    def describe(self) -> str:
        """One line for logs and the demo screen."""
        where = f" (seen by {self.reporter})" if self.reporter else ""
        return f"{self.kind.name} {self.subject}: {self.evidence}{where} [gen {self.generation}]"

    def to_proto(self) -> common_pb2.FailureEvent:
        return common_pb2.FailureEvent(
            kind=self.kind.value,
            subject=self.subject,
            evidence=self.evidence,
            time_unix_ms=self.time_unix_ms,
            generation=self.generation,
            reporter=self.reporter,
            captured_step=self.captured_step,
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.FailureEvent) -> Failure:
        if msg.kind == common_pb2.FailureEvent.KIND_UNSPECIFIED:
            raise ValueError(
                f"failure report about {msg.subject!r} has no kind; the reporter must set "
                "FailureEvent.kind"
            )
        return cls(
            kind=FailureKind(msg.kind),
            subject=msg.subject,
            evidence=msg.evidence,
            generation=msg.generation,
            reporter=msg.reporter,
            time_unix_ms=msg.time_unix_ms,
            captured_step=msg.captured_step,
        )
