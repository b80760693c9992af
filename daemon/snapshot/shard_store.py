"""Shards on this node's disk: `root/<job_id>/<shard_id>` plus a JSON sidecar each.

Identifiers follow one strict grammar before they touch a path, so no request can
name a file outside the store; a shard becomes visible only once written whole
(temp file, fsync when every write is synced, rename).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from stalwart.daemon.snapshot.atomic import EACH_WRITE, DiskSync
from stalwart.daemon.snapshot.checksum import crc32c

MAX_ID_CHARS = 256
MAX_PART_CHARS = 200      # one path component, leaving room for sidecar and temp suffixes
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_META = ".meta.json"


def validate_id(value: str, what: str, allow_slash: bool = True) -> str:
    """`value` if it is a safe relative identifier, else ValueError saying why.

    Allowed: components of [A-Za-z0-9._-] (not starting with '.' or '-') joined by
    '/' when `allow_slash`; so no '..', no absolute paths, no empty components.
    """
    if not value or len(value) > MAX_ID_CHARS:
        raise ValueError(f"{what} must be 1-{MAX_ID_CHARS} characters, got {len(value)}")
    parts = value.split("/") if allow_slash else [value]
    if any(len(p) > MAX_PART_CHARS for p in parts):
        raise ValueError(f"{what} has a part longer than {MAX_PART_CHARS} characters")
    if any(not _PART.fullmatch(p) for p in parts) or value.endswith(_META):
        raise ValueError(
            f"{what} {value!r} is not allowed: use letters, digits, '.', '_', '-'"
            + (" and '/' between parts" if allow_slash else "")
            + ", not starting with '.' or '-'")
    return value


class ShardStore:
    """Shards of every job under `root/<job_id>/<shard_id>`, with a JSON sidecar each."""

    def __init__(self, root: Path, sync: DiskSync = EACH_WRITE) -> None:
        self.root = Path(root)
        self.sync = sync
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, job_id: str, shard_id: str) -> Path:
        validate_id(job_id, "job_id", allow_slash=False)
        validate_id(shard_id, "shard_id")
        return self.root / job_id / shard_id

    def meta(self, path: Path) -> dict:
        return json.loads(path.with_name(path.name + _META).read_text())

    def _meta_or_empty(self, path: Path) -> dict:
        """The shard's sidecar, or {} when it is missing or does not read (a power loss
        can tear sidecars written in the background)."""
        try:
            meta = self.meta(path)
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def commit(self, tmp: Path, path: Path, meta: dict) -> None:
        """Make a fully written temp file visible under `path` (durably, when every
        write is synced)."""
        side = path.with_name(path.name + _META)
        side_tmp = side.with_name(side.name + f".tmp-{uuid.uuid4().hex}")
        with side_tmp.open("w") as f:
            f.write(json.dumps(meta))
            f.flush()
            self.sync.file(f.fileno())
        os.replace(tmp, path)
        os.replace(side_tmp, side)
        self.sync.folder(path.parent)

    def put(self, job_id: str, shard_id: str, data: bytes | memoryview, meta: dict) -> None:
        """Write a whole shard at once (this daemon's own shards: no stream, no network)."""
        path = self.path(job_id, shard_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
        try:
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                self.sync.file(f.fileno())
            self.commit(tmp, path, meta)
        finally:
            tmp.unlink(missing_ok=True)

    def read(self, job_id: str, shard_id: str) -> tuple[bytes, dict]:
        """A shard's bytes and sidecar; OSError or ValueError when it is not (whole) here."""
        path = self.path(job_id, shard_id)
        meta = self.meta(path)
        return path.read_bytes(), meta

    def delete(self, job_id: str, shard_ids: list[str], below_step: int,
               refuse: Callable[[dict], str] = lambda meta: "") -> tuple[int, list[str]]:
        """Remove the named shards and, when below_step > 0, every shard of an older step,
        except those `refuse(meta)` gives a reason to keep; returns (deleted, reasons)."""
        job_dir = self.root / validate_id(job_id, "job_id", allow_slash=False)
        doomed = {self.path(job_id, s) for s in shard_ids}
        if below_step and job_dir.is_dir():
            for side in job_dir.rglob("*" + _META):
                path = side.with_name(side.name[: -len(_META)])
                if self._meta_or_empty(path).get("step", 0) < below_step:  # unreadable: doomed
                    doomed.add(path)
        deleted, kept = 0, []
        for path in doomed:
            if not path.is_file():
                continue
            why = refuse(self._meta_or_empty(path))
            if why:
                kept.append(why)
                continue
            path.unlink()
            deleted += 1
            path.with_name(path.name + _META).unlink(missing_ok=True)
        return deleted, kept

    def scrub(self) -> list[str]:
        """Paths (relative to root) of stored shards whose CRC32C no longer matches."""
        bad = []
        for side in sorted(self.root.rglob("*" + _META)):
            path = side.with_name(side.name[: -len(_META)])
            crc = self._meta_or_empty(path).get("crc32c")  # a torn sidecar: bad too
            if crc is None or not path.exists() or crc32c(path.read_bytes()) != crc:
                bad.append(str(path.relative_to(self.root)))
        return bad
