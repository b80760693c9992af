"""Background scrub: re-verify the CRC32C of every shard this daemon stores, periodically.

A shard that fails is deleted (peers then read around it at once instead of after a
DATA_LOSS answer) and re-created here from k good shards elsewhere. Shards of steps
older than every retained step are deleted first (retention of the shard store).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from stalwart.core import manifest as mf
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot.catalogue import FetchRecords
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.shard_reader import ShardReader
from stalwart.daemon.snapshot.shard_store import ShardStore
from stalwart.v1 import manifest_pb2

log = logging.getLogger("stalwart.daemon.snapshot.scrub")

# Seconds between passes; a pass reads every stored shard once.
DEFAULT_INTERVAL_S = float(os.environ.get("STALWART_SCRUB_INTERVAL_S", "300"))

Put = Callable[[str, bytes, int, int], Awaitable[None]]  # shard id, body, step, generation
_SHARD_ID = re.compile(r"s(?P<step>\d+)-r(?P<rank>\d+)-c\d+\.\d+")  # chunks.chunk_id + index


@dataclass
class ScrubState:
    passes: int = 0
    bad: int = 0              # shards found corrupt since the daemon started
    recreated: int = 0
    retired: int = 0          # shards of retired steps deleted
    last: str = "no pass yet"


class Scrubber:
    """Verifies `shard_dir` (this daemon's ShardService store) every `interval_s` seconds."""

    def __init__(self, *, node: str, job_id: str, shard_dir: Path, store: LocalStore,
                 metrics: Metrics, reader: Callable[[], ShardReader], put_local: Put,
                 fetch_records: FetchRecords, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.node, self.job_id, self.shard_dir = node, job_id, shard_dir
        self.store, self.metrics, self.reader, self.put_local = store, metrics, reader, put_local
        self.fetch_records, self.interval_s = fetch_records, interval_s
        self.state = ScrubState()

    async def forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.scrub_once()
            except Exception:
                log.exception("scrub pass failed")

    async def scrub_once(self) -> list[str]:
        """One pass; returns the shard ids found corrupt (already re-created when possible)."""
        if not self.shard_dir.is_dir():
            return []
        shards = ShardStore(self.shard_dir)
        started = time.monotonic()
        steps = await asyncio.to_thread(self.store.committed_steps)
        if steps:
            retired, _ = await asyncio.to_thread(shards.delete, self.job_id, [], steps[0])
            self.state.retired += retired
        bad_paths = await asyncio.to_thread(shards.scrub)
        prefix = self.job_id + "/"
        bad = [p[len(prefix):] for p in bad_paths if p.startswith(prefix)]
        self.state.passes += 1
        if bad:
            self.state.bad += len(bad)
            self.metrics.scrub_errors.labels("scrub").inc(len(bad))
            log.error("scrub found corrupt shards", extra={"shards": bad})
            await asyncio.to_thread(shards.delete, self.job_id, bad, 0)
            for sid in bad:
                await self._recreate(sid)
        st = self.state
        st.last = (f"pass {st.passes} ({time.monotonic() - started:.1f} s): {len(bad)} corrupt "
                   f"shards; since start {st.bad} corrupt, {st.recreated} re-created, "
                   f"{st.retired} of retired steps deleted")
        return bad

    async def _recreate(self, sid: str) -> None:
        found = await asyncio.to_thread(self._find, sid)
        if found is None:
            return  # a shard of a retired or uncommitted step: deleting it was enough
        step, generation, chunk, index = found
        try:
            body = (await self.reader().recreate_shards(chunk, [index]))[index]
            await self.put_local(sid, body, step, generation)
        except Exception as exc:
            log.error("corrupt shard could not be re-created",
                      extra={"shard": sid, "error": str(exc)})
            return
        self.state.recreated += 1
        self.metrics.repaired_shards.inc()

    def _find(self, sid: str) -> tuple[int, int, manifest_pb2.ChunkRecord, int] | None:
        """The committed chunk a shard id ("s<step>-r<rank>-c<i>.<index>") belongs to,
        from its rank's record (held here or fetched from its holders)."""
        named = _SHARD_ID.fullmatch(sid)
        if named is None:
            return None
        step, rank = int(named["step"]), int(named["rank"])
        if step not in self.store.committed_steps():
            return None
        try:
            state = self.store.rank_record(step, rank, self.fetch_records)
        except (LookupError, mf.ManifestError) as exc:
            log.error("the record of a corrupt shard is not readable",
                      extra={"shard": sid, "error": str(exc)})
            return None
        for c in state.chunks:
            for rec in c.shards:
                if rec.node == self.node and (rec.location or f"{c.chunk_id}.{rec.index}") == sid:
                    return step, self.store.load_record(step).generation, c, rec.index
        return None
