"""When a node's refused captures end its ranks' roles (`daemon/snapshot/disk_watch.py`):
only storage refusals count, only once they have lasted `replan_s` within one plan, each
rank of that plan on the node once, and a stored capture ends the spell. Pure logic with
a stand-in clock; tests/test_disk_full_replan.py runs it on a filled tmpfs."""

from __future__ import annotations

import errno

from stalwart.core.failures import Failure, FailureKind
from stalwart.daemon.snapshot.disk_watch import DiskWatch, refusal
from stalwart.daemon.snapshot.quota import QuotaExceeded
from stalwart.daemon.snapshot.shard_client import ShardTransferError

FULL = OSError(errno.ENOSPC, "No space left on device")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch(replan_s: float = 10.0) -> tuple[DiskWatch, Clock, list[Failure]]:
    clock, reported = Clock(), []
    ranks = {3: ["node-1/11", "node-1/12"]}
    return DiskWatch("node-1", replan_s, ranks.get, reported.append, clock), clock, reported


def test_refusals_past_the_grace_report_each_rank_of_the_plan_once():
    w, clock, reported = watch()
    w.refused(FULL, 3)
    clock.now += 9.9
    w.refused(FULL, 3)
    assert reported == []
    clock.now += 0.2
    w.refused(FULL, 3)
    w.refused(FULL, 3)
    assert [(f.kind, f.subject, f.generation) for f in reported] == [
        (FailureKind.STORAGE_FULL, "node-1/11", 3), (FailureKind.STORAGE_FULL, "node-1/12", 3)]
    assert "refused its captures for 10 s" in reported[0].evidence
    assert "No space left on device" in reported[0].evidence


def test_a_stored_capture_ends_the_spell():
    w, clock, reported = watch()
    w.refused(FULL, 3)
    clock.now += 8
    w.stored()
    w.refused(FULL, 3)
    clock.now += 8
    w.refused(FULL, 3)
    assert reported == []


def test_a_new_plan_starts_the_clock_again():
    w, clock, reported = watch()
    w.refused(FULL, 3)
    clock.now += 8
    w.refused(FULL, 4)  # a plan since: its ranks get the whole grace
    clock.now += 8
    w.refused(FULL, 4)
    assert reported == []  # (and plan 4 gives this node no role in this stand-in)


def test_other_errors_and_a_zero_grace_never_report():
    w, clock, reported = watch()
    w.refused(OSError(errno.EIO, "Input/output error"), 3)
    clock.now += 60
    w.refused(ValueError("a bug"), 3)
    assert reported == []
    off, clock, reported = watch(replan_s=0)
    off.refused(FULL, 3)
    clock.now += 3600
    off.refused(FULL, 3)
    assert reported == []


def test_what_counts_as_a_refusal():
    assert refusal(FULL) is not None
    assert refusal(OSError(errno.EDQUOT, "Disk quota exceeded")) is not None
    assert refusal(QuotaExceeded("over disk_quota_bytes")) == "over disk_quota_bytes"
    assert refusal(ShardTransferError("n (local)", "s1", "put", "full", full=True))
    assert refusal(ShardTransferError("n2", "s1", "put", "unreachable")) is None
    assert refusal(OSError(errno.EIO, "Input/output error")) is None
