"""`stalwart export` / `stalwart import`: committed steps <-> standard PyTorch checkpoints.

Export reads every rank of a committed step (from a running daemon, or offline from a
store directory), reassembles full-size tensors from the TP shards and pipeline stages
of data-parallel replica 0, and writes them with torch.save or torch.distributed.checkpoint
(`checkpoint_files`, which also reads them back).
Import reads such a file (tensors only) and commits it as a (1,1,1) step of a local store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.client.checkpoint_files import (
    EXTRA_KEY,
    FORMATS,
    InteropError,
    json_tensor,
    load,
    save,
)
from stalwart.daemon.config_schema import SOCKET_LOOKUP, socket_in

if TYPE_CHECKING:
    import torch

    from stalwart.v1 import manifest_pb2

CONFIGURE_TAKES_NAME = True


# --- reading a committed step ---------------------------------------------------------


def read_from_daemon(step: int, target: str | None = None
                     ) -> list[tuple[manifest_pb2.RankState, bytes]]:
    """Every rank's record and state bytes of committed `step` (0: the latest) through the
    daemon's Restore calls; the step's world size comes from rank 0's layout record."""
    from stalwart.client.daemon_client import DaemonClient

    client = DaemonClient(target)
    try:
        first = client.restore(step, 0, into_slot=False)  # bytes for a file, many ranks
        layout = json.loads(first[0].extra.decode())["layout"]
        world = layout["dp"] * layout["pp"] * layout["tp"]
        step = step or json.loads(first[0].extra.decode())["step"]
        return [first, *(client.restore(step, r, into_slot=False) for r in range(1, world))]
    finally:
        client.close(leaving=False)


def read_from_store(data_dirs: Sequence[Path], job_id: str, step: int
                    ) -> list[tuple[manifest_pb2.RankState, bytes]]:
    """The same, offline from stores no daemon is writing: the ranks of data-parallel
    replica 0 (the others hold identical copies). Records and chunks come from any of
    `data_dirs`; a chunk none holds whole is rebuilt from any k of its erasure shards
    found in them, every checksum verified."""
    from stalwart.core.step_record import MissingRecords
    from stalwart.daemon.snapshot.chain_reader import CorruptChunkError
    from stalwart.daemon.snapshot.local_store import LocalStore
    from stalwart.daemon.snapshot.records import from_disks
    from stalwart.daemon.snapshot.shard_reader import (
        BeyondToleranceError,
        ChunkChecksumError,
        ShardReader,
    )

    for data_dir in data_dirs:
        _refuse_live_daemon(data_dir)
        if not (data_dir / "snapshots" / job_id / "manifests").is_dir():
            raise InteropError(f"{data_dir} holds no snapshots of job {job_id!r} "
                               f"(no {data_dir}/snapshots/{job_id}/manifests)")
    stores = [LocalStore(d, job_id=job_id, ram_tier_bytes=0) for d in data_dirs]
    store = stores[0]
    step = step or store.latest_committed() or 0
    try:
        manifest = store.load_manifest(step, from_disks(stores))
    except MissingRecords as exc:
        raise InteropError(f"{exc}: give every data dir of the job (--data-dir, repeated), "
                           "or export through a running daemon with --socket") from None
    shards = _OfflineShards(data_dirs, job_id)
    nodes = {rec.node for r in manifest.ranks for c in r.chunks for rec in c.shards}
    reader = ShardReader(node="export", peers=dict.fromkeys(nodes, shards))

    def fetch(chunk: manifest_pb2.ChunkRecord) -> bytes:
        return asyncio.run(reader.read_chunk(chunk))

    def holding(rank: int) -> LocalStore:
        """The store whose disk keeps the rank's chunks whole, if one does (always the
        capturing daemon's for chunks without shards)."""
        return next((st for st in stores if st.chunk_path(step, rank, 0).exists()), store)

    out = []
    for r in manifest.ranks:
        if r.coord.dp != 0:
            continue
        try:
            out.append((r, holding(r.rank).read_rank(step, r.rank, fetch,
                                                     from_disks(stores))))
        except (CorruptChunkError, BeyondToleranceError, ChunkChecksumError) as exc:
            raise InteropError(
                f"{exc}. Rank {r.rank} was captured on node {r.node!r}; its chunks are whole "
                "on that node's disk or erasure shards on the job's daemons: give every "
                "data dir of the job (--data-dir, repeated), or export through a running "
                "daemon with --socket") from None
    return out


class _OfflineShards:
    """Shards in any of some data dirs' shard stores, served as ShardClient.get does."""

    def __init__(self, data_dirs: Sequence[Path], job_id: str) -> None:
        from stalwart.daemon.snapshot.shard_store import ShardStore

        self.stores, self.job_id = [ShardStore(d / "shards") for d in data_dirs], job_id
        self.address = "the data dirs given"

    async def get(self, shard_id: str, *, expected_crc: int | None = None,
                  expected_size: int | None = None, deadline_s: float | None = None) -> bytes:
        from stalwart.daemon.snapshot.checksum import crc32c
        from stalwart.daemon.snapshot.shard_client import ShardTransferError

        for store in self.stores:
            try:
                data, meta = store.read(self.job_id, shard_id)
            except (OSError, ValueError):
                continue
            want = meta["crc32c"] if expected_crc is None else expected_crc
            if crc32c(data) == want and expected_size in (None, len(data)):
                return data
        raise ShardTransferError(self.address, shard_id, "get", "no good copy in them")


def _refuse_live_daemon(data_dir: Path) -> None:
    path = Path(socket_in(data_dir))
    if not path.exists():
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return  # a stale socket file of a stopped daemon
    raise InteropError(f"a daemon is running on {data_dir}; export through it with "
                       f"--socket {path} instead of reading its store directly")


def assemble_full(ranks: list[tuple[manifest_pb2.RankState, bytes]]) -> dict[str, torch.Tensor]:
    """Full-size model and optimizer tensors (plus rank 0's RNG and extra) of one step."""
    from stalwart.client.reshard import Piece, Want, assemble
    from stalwart.client.state_layout import unpack

    pieces: dict[str, list[Piece]] = {}
    extras = []
    for state, data in sorted(ranks, key=lambda r: r[0].rank):
        if state.coord.dp != 0:
            continue  # data-parallel replicas hold identical copies
        tensors = unpack(data, list(state.tensors))
        extras.append(json.loads(state.extra.decode()))
        for meta in state.tensors:
            if not meta.name.startswith("rng/") or state.rank == 0:
                pieces.setdefault(meta.name, []).append(Piece(
                    meta.name, tensors[meta.name], tuple(meta.global_shape),
                    tuple(meta.offsets)))
    if not extras:
        raise InteropError("the step has no rank of data-parallel replica 0")
    out = {}
    for name, group in pieces.items():
        shape = group[0].global_shape
        out[name] = assemble(Want(name, shape, (0,) * len(shape), shape), group)
    out[EXTRA_KEY] = json_tensor(_full_extra(extras, out))
    return out


def _full_extra(extras: list[dict[str, Any]], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Rank 0's extra, its layout rewritten as the single-rank layout of the full state
    (a model of the 3D loop; a model of the user's own loop has one layout already)."""
    extra = dict(extras[0])
    if not all(_is_layer_name(n) for n in tensors if n.startswith("model/")):
        return extra
    layers = _layer_count(tensors)
    shard_dims: dict[str, Any] = {}
    for e in extras:
        shard_dims.update(e.get("layout", {}).get("shard_dims", {}))
    extra["layout"] = {"dp": 1, "pp": 1, "tp": 1, "coords": {"dp": 0, "pp": 0, "tp": 0},
                       "stage_bounds": [[0, layers - 1]], "schedule": "1f1b",
                       "microbatches": 1, "grad_accum": 1, "shard_dims": shard_dims}
    return extra


def _layer_count(tensors: Mapping[str, Any]) -> int:
    layers = [int(n.split("/")[1].split(".")[1]) for n in tensors if n.startswith("model/")]
    if not layers:
        raise InteropError("the checkpoint holds no model parameters (model/layers.N.*)")
    return max(layers) + 1


# --- committing a checkpoint as a step -------------------------------------------------


def commit_checkpoint(tensors: dict[str, torch.Tensor], data_dir: Path, step: int,
                      job_id: str = "default") -> None:
    """Write `tensors` as committed `step` of layout (1,1,1) in the store under data_dir."""
    from stalwart.client.state_layout import StateTensor, describe, pack_into
    from stalwart.core import manifest as mf
    from stalwart.core import step_record as sr
    from stalwart.daemon.snapshot.local_store import LocalStore
    from stalwart.v1 import common_pb2

    _refuse_live_daemon(data_dir)
    named = {(k if k.startswith(("model/", "optim/", "rng/", "stalwart/")) else f"model/{k}"): v
             for k, v in tensors.items()}
    unknown = [k for k in named if k.startswith("model/") and not _is_layer_name(k)]
    if unknown:
        raise InteropError(f"entries {unknown[:3]} are not parameters of a model in "
                           "Stalwart's 3D loop (model/layers.N.*); export from Stalwart or "
                           "rename them")
    layers = _layer_count(named)
    extra = _extra_for(named, step, layers)
    states = [StateTensor(k, v.detach().contiguous(), _layer_of(k))
              for k, v in sorted(named.items()) if k != EXTRA_KEY]
    metas, nbytes = describe(states)
    import torch

    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    pack_into(buffer, states, metas)
    store = LocalStore(data_dir, job_id=job_id, ram_tier_bytes=0)
    if step in store.committed_steps():
        raise InteropError(f"step {step} is already committed in {store.root}; choose another "
                           "--step or another --data-dir")
    layout = common_pb2.ParallelLayout(
        dp=1, pp=1, tp=1, schedule="1f1b", microbatches=1, grad_accum=1,
        stages=[common_pb2.StageBounds(first_layer=0, last_layer=layers - 1)])
    prepared = store.encode(step, 0, buffer.numpy(), metas, coord=common_pb2.RankCoord(rank=0),
                            extra=json.dumps(extra, sort_keys=True).encode())
    state = store.prepare(step, prepared)
    store.commit(sr.split(mf.build_manifest(job_id=job_id, step=step, generation=0,
                                            layout=layout, ranks=[state],
                                            base_step=prepared.root_step)))


def _is_layer_name(key: str) -> bool:
    parts = key.split("/")[1].split(".")
    return len(parts) >= 3 and parts[0] == "layers" and parts[1].isdigit()


def _layer_of(key: str) -> int:
    return int(key.split("/")[1].split(".")[1]) if key.startswith(("model/", "optim/")) else -1


def _extra_for(named: Mapping[str, torch.Tensor], step: int, layers: int) -> dict[str, Any]:
    """The checkpoint's own extra (from a Stalwart export), else what a foreign one implies:
    no data position, scaler or optimizer hyperparameters (the job's defaults apply)."""
    if EXTRA_KEY in named:
        extra = json.loads(bytes(named[EXTRA_KEY].numpy()).decode())
        extra["step"] = step
        return extra
    return {"format": 1, "step": step, "imported": True, "scaler": None, "data": None,
            "param_groups": None,
            "layout": {"dp": 1, "pp": 1, "tp": 1, "coords": {"dp": 0, "pp": 0, "tp": 0},
                       "stage_bounds": [[0, layers - 1]], "schedule": "1f1b",
                       "microbatches": 1, "grad_accum": 1, "shard_dims": {}}}


# --- the CLI ---------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser, name: str = "export") -> None:
    parser.set_defaults(interop=name)
    parser.add_argument("path", type=Path, help="checkpoint file (state_dict) or directory (dcp)")
    parser.add_argument("--job", default=os.environ.get("STALWART_JOB_ID") or "default",
                        help="job id of the snapshots (default: $STALWART_JOB_ID or 'default')")
    if name == "export":
        parser.add_argument("--step", type=int, default=0,
                            help="committed step to export (default: the latest)")
        parser.add_argument("--format", choices=FORMATS, default="state_dict",
                            help="torch.save dict of tensors, or torch.distributed.checkpoint")
        source = parser.add_mutually_exclusive_group()
        source.add_argument("--socket", type=Path,
                            help=f"Unix socket of a running daemon (default: {SOCKET_LOOKUP})")
        source.add_argument("--data-dir", type=Path, action="append",
                            help="read the store offline (no daemon running on it); repeat "
                                 "it with every data dir of the job, whose chunks are kept "
                                 "as erasure shards across them")
    else:
        parser.add_argument("--data-dir", type=Path, required=True,
                            help="daemon data directory to write the step into (offline)")
        parser.add_argument("--step", type=int, required=True, help="step number to commit")


def run(args: argparse.Namespace) -> int:
    try:
        if args.interop == "export":
            if args.data_dir is not None:
                ranks = read_from_store(args.data_dir, args.job, args.step)
            else:
                ranks = read_from_daemon(args.step, f"unix:{args.socket}" if args.socket
                                         else None)
            tensors = assemble_full(ranks)
            save(tensors, args.path, args.format)
            step = json.loads(bytes(tensors[EXTRA_KEY].numpy()).decode())["step"]
            print(f"exported step {step} ({len(tensors)} tensors) to {args.path}")
        else:
            tensors = load(args.path)
            commit_checkpoint(tensors, args.data_dir, args.step, args.job)
            print(f"imported {len(tensors)} tensors as step {args.step} of job {args.job!r} "
                  f"in {args.data_dir}")
    except (RuntimeError, FileNotFoundError, ValueError) as exc:  # InteropError, daemon, chunks
        print(f"stalwart {args.interop}: {exc}", file=sys.stderr)
        return 1
    return 0
