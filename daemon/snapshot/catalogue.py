"""What a daemon's store knows of committed steps: their records (`StepRecord`, one
small file per step), and the records of ranks this disk holds (its own ranks', and the
copies it keeps for peers) or fetches, each checked against its seal before use.

`LocalStore` is a catalogue with the chunks, the encoding and the retention on top.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from google.protobuf.message import DecodeError

from stalwart.core import manifest as mf
from stalwart.core import step_record as sr
from stalwart.daemon.snapshot.atomic import EACH_WRITE, DiskSync, write_atomic
from stalwart.v1 import manifest_pb2

_STEP_DIGITS = 12  # zero-padded step numbers sort as text

log = logging.getLogger("stalwart.daemon.snapshot.catalogue")

# The records one seal of a step names, from their holders (verified by the catalogue).
FetchRecords = Callable[[manifest_pb2.StepRecord, manifest_pb2.RankSeal],
                        list[manifest_pb2.RankState]]


class Catalogue:
    """Committed steps and rank records under `root` (one writer process; the lock is the
    store's, shared with its commits and retention)."""

    def __init__(self, root: Path, sync: DiskSync = EACH_WRITE) -> None:
        self.root, self.sync = root, sync
        self._records: dict[int, manifest_pb2.StepRecord] = {}
        self._checked: dict[tuple[int, int], manifest_pb2.RankState] = {}  # vs their seal
        # held_manifest per committed step (status and the protection census ask for
        # every retained step often); `_changes` counts what may change one
        self._held: dict[int, manifest_pb2.Manifest] = {}
        self._changes = 0
        # The committed steps as last listed, under (the manifests folder's mtime, the
        # count of this store's own writes and removals of records) then: status, the
        # census and the commit path ask many times a step, and listing is a glob.
        self._steps: tuple[tuple[int, int], list[int]] | None = None
        self._step_writes = 0
        self._lock = threading.RLock()
        (self.root / "manifests").mkdir(parents=True, exist_ok=True)
        (self.root / "steps").mkdir(parents=True, exist_ok=True)
        self.set_aside_torn()

    def set_aside_torn(self) -> list[Path]:
        """Set aside the committed and rank records on this disk that do not read whole:
        renamed `<name>.torn` and logged, so the store reads on without them (the step is
        then not committed here, and its ranks' records are fetched from their holders).

        A power loss can leave them so when files reach the disk in the background
        (`DiskSync`): written and renamed, but not yet written back. A record of a newer
        format than this build reads is left alone: that error is raised where it is read."""
        torn = []
        for path in [*(self.root / "manifests").glob("*.step"),
                     *(self.root / "steps").glob("*/r*/rank.pb")]:
            try:
                data = path.read_bytes()
                if path.suffix == ".step":
                    record = manifest_pb2.StepRecord.FromString(data)
                    if record.format_version in (0, mf.FORMAT_VERSION):
                        sr.verify(record)
                else:
                    manifest_pb2.RankState.FromString(data)
                whole = bool(data)
            except (DecodeError, ValueError):
                whole = False
            if not whole:
                path.rename(path.with_name(path.name + ".torn"))
                torn.append(path)
        if torn:
            self._steps_written()
            log.warning("set aside %d record(s) that do not read whole (a power loss before "
                        "they were written back to disk?); the steps they name are read "
                        "from other nodes", len(torn),
                        extra={"records": [str(p.relative_to(self.root)) for p in torn[:8]]})
        return torn

    def _record_path(self, step: int) -> Path:
        return self.root / "manifests" / f"{step:0{_STEP_DIGITS}d}.step"

    def _rank_dir(self, step: int, rank: int) -> Path:
        return self.root / "steps" / f"{step:0{_STEP_DIGITS}d}" / f"r{rank}"

    def keep_records(self, step: int, states: Sequence[manifest_pb2.RankState]) -> None:
        """Keep copies of other daemons' records (this daemon is one of their holders, or
        fetched them to restore); checked against their seal when read."""
        with self._lock:  # copies of one record may arrive at once (a repair, a re-copy)
            for state in states:
                rank_dir = self._rank_dir(step, state.rank)
                rank_dir.mkdir(parents=True, exist_ok=True)
                write_atomic(rank_dir / "rank.pb", state.SerializeToString(deterministic=True),
                             self.sync)
                self._checked.pop((step, state.rank), None)
            self._forget_held([step])
            if states:
                self.sync.folder(self._rank_dir(step, states[0].rank).parent)

    def held_record(self, step: int, rank: int) -> manifest_pb2.RankState | None:
        """The record of (step, rank) on this disk as written, or None."""
        path = self._rank_dir(step, rank) / "rank.pb"
        try:
            return manifest_pb2.RankState.FromString(path.read_bytes())
        except (FileNotFoundError, DecodeError):  # not here, or torn: fetched elsewhere
            return None

    def committed_steps(self) -> list[int]:
        folder = self.root / "manifests"
        key = (folder.stat().st_mtime_ns, self._step_writes)  # before the listing
        listed = self._steps  # one read: another thread may replace it meanwhile
        if listed is None or listed[0] != key:
            listed = (key, sorted(int(p.name.split(".")[0]) for p in folder.glob("*.step")))
            self._steps = listed  # an older listing's key no longer matches: re-listed
        return list(listed[1])

    def _steps_written(self) -> None:
        """This store wrote or removed committed records: list them again (a folder's
        mtime may not change within one tick of the kernel's coarse clock)."""
        self._step_writes += 1

    def latest_committed(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def load_record(self, step: int) -> manifest_pb2.StepRecord:
        """The committed record of `step`, digest verified."""
        if step in self._records:
            return self._records[step]
        path = self._record_path(step)
        if not path.exists():
            raise FileNotFoundError(f"step {step} is not committed in {self.root}; committed: "
                                    f"{self.committed_steps()[-5:]}")
        record = manifest_pb2.StepRecord.FromString(path.read_bytes())
        sr.verify(record)
        self._records[step] = record
        return record

    def committed_records(self) -> dict[int, manifest_pb2.StepRecord]:
        return {s: self.load_record(s) for s in self.committed_steps()}

    def records(self, step: int, seal: manifest_pb2.RankSeal,
                fetch: FetchRecords | None = None) -> list[manifest_pb2.RankState]:
        """The records `seal` of committed `step` names, checked against it: from this
        disk, else fetched (not kept: the holders a repair updates are the ones that keep
        copies). MissingRecords when neither has them."""
        record = self.load_record(step)
        ranks = list(seal.ranks)
        if all((step, r) in self._checked for r in ranks):
            return [self._checked[(step, r)] for r in ranks]
        held = [self.held_record(step, r) for r in ranks]
        if all(h is not None for h in held):
            try:
                sr.check(record, held)
            except mf.ManifestError:
                if fetch is None:
                    raise
            else:
                with self._lock:  # a commit's garbage collection walks this map
                    self._checked.update(((step, h.rank), h) for h in held)
                return held
        if fetch is None:
            raise sr.MissingRecords(step, ranks)
        fetched = fetch(record, seal)
        sr.check(record, fetched)
        return sorted(fetched, key=lambda f: f.rank)

    def rank_record(self, step: int, rank: int, fetch: FetchRecords | None = None
                    ) -> manifest_pb2.RankState:
        """The checked record of one rank of committed `step` (see `records`)."""
        seal = sr.seal_of(self.load_record(step), rank)
        return next(r for r in self.records(step, seal, fetch) if r.rank == rank)

    def load_manifest(self, step: int, fetch: FetchRecords | None = None
                      ) -> manifest_pb2.Manifest:
        """Committed `step` whole, every rank's record (fetched where not held here)."""
        record = self.load_record(step)
        states = [s for seal in record.seals for s in self.records(step, seal, fetch)]
        return sr.assemble(record, states)

    @property
    def changes(self) -> int:
        """Grows whenever records are written or removed: what is counted from them is
        current while it stays the same."""
        return self._changes

    def _forget_held(self, steps: Sequence[int]) -> None:
        """Records of `steps` were written or removed: their held manifests are redone."""
        self._changes += 1
        for step in steps:
            self._held.pop(step, None)

    def held_manifest(self, step: int) -> manifest_pb2.Manifest:
        """Committed `step` with the records this disk holds (its own ranks' and the
        copies it keeps for peers), each checked: what this daemon can vouch for. Kept
        until that step's records change; callers share it and must not modify it."""
        if (held := self._held.get(step)) is not None:
            return held
        changes = self._changes
        held = self._held_manifest(step)
        if changes == self._changes:  # no record written or removed meanwhile
            self._held[step] = held
        return held

    def _held_manifest(self, step: int) -> manifest_pb2.Manifest:
        record = self.load_record(step)
        states = []
        for seal in record.seals:
            try:
                states += self.records(step, seal)
            except (sr.MissingRecords, mf.ManifestError):
                continue
        return manifest_pb2.Manifest(
            format_version=mf.FORMAT_VERSION, job_id=record.job_id, step=step,
            generation=record.generation, layout=record.layout, ranks=states,
            base_step=record.base_step, created_unix_ms=record.created_unix_ms)
