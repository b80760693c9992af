"""`stalwart export` / `stalwart import`: committed steps <-> standard PyTorch checkpoints.

Export reads every rank of a committed step (from a running daemon, or offline from a
store directory), reassembles full-size tensors from the TP shards and pipeline stages
of data-parallel replica 0, and writes them with torch.save or torch.distributed.checkpoint.
Import reads such a file (tensors only) and commits it as a (1,1,1) step of a local store.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import pickle
import socket
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.daemon.config_schema import SOCKET_LOOKUP, socket_in

if TYPE_CHECKING:
    import torch

    from stalwart.v1 import manifest_pb2

CONFIGURE_TAKES_NAME = True
EXTRA_KEY = "stalwart/extra"  # JSON (step, data position, scaler, hyperparameters) as uint8
FORMATS = ("state_dict", "dcp")

# state_dict (torch.save) keys, the snapshot's own names:
#   model/<canonical param>        full parameter, e.g. model/layers.1.attn.qkv.weight
#   optim/<canonical param>/<key>  AdamW state: exp_avg, exp_avg_sq (full size), step
#   rng/cpu                        CPU generator state of rank 0
#   stalwart/extra                 the rest, as JSON bytes
# A DCP export is laid out as torch users lay out a job (see torch_native): the model's
# own state_dict() keys at the top, "optimizer" in torch.optim form keyed by parameter
# name, other registered objects under their names, Stalwart's record under "stalwart".
NATIVE_NAMES = "dcp_names"  # in the extra of a DCP export: DCP key -> snapshot name


class InteropError(RuntimeError):
    """A checkpoint or step cannot be exported or imported; the message says why."""


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
    from stalwart.daemon.snapshot.local_store import CorruptChunkError, LocalStore
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
    out[EXTRA_KEY] = _json_tensor(_full_extra(extras, out))
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


def _json_tensor(value: Any) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(json.dumps(value, sort_keys=True).encode()),
                            dtype=torch.uint8)


# --- writing and reading checkpoint files ---------------------------------------------


def save(tensors: dict[str, torch.Tensor], path: Path, fmt: str) -> None:
    """torch.save of the plain dict, or a single-process DCP save into directory `path`."""
    import torch

    if fmt == "state_dict":
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(tensors, tmp)
        tmp.replace(path)
    elif fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        state = torch_native(tensors)
        with _single_process():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    else:
        raise InteropError(f"unknown format {fmt!r}; use one of {FORMATS}")


def torch_native(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """One step as a torch.distributed.checkpoint user lays out a job, so that

        model_sd, optim_sd = get_state_dict(model, optimizer)   # ...checkpoint.state_dict
        state = {**model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict={k: state[k] for k in model_sd},
                       optim_state_dict=state["optimizer"])

    fills a plain model and optimizer (`dcp.load(model.state_dict(), ...)` alone loads the
    model): the model's own state_dict() keys at the top; "optimizer" in torch.optim form
    keyed by parameter name (what get_state_dict gives); other registered objects (a
    scheduler, the data position) under their names; Stalwart's RNG and record under
    "stalwart", the record naming each DCP key's snapshot tensor for `stalwart import`.
    """
    from stalwart.client.user_state import _unflatten

    extra = json.loads(bytes(tensors[EXTRA_KEY].numpy()).decode())
    state: dict[str, Any] = {}
    if "objects" in extra:  # the user's own loop: each registered object as it saved itself
        for key, record in extra["objects"].items():
            value = _unflatten(record, tensors)
            if _is_optimizer_record(record):
                value = _by_parameter_name(value)
            if key == "model":
                state.update(value)
            else:
                state[key] = value
    else:  # the 3D loop: canonical names, one AdamW
        params = [n.removeprefix("model/") for n in tensors if n.startswith("model/")]
        state.update({n: tensors[f"model/{n}"] for n in params})
        moments: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            if name.startswith("optim/"):
                fqn, _, key = name.removeprefix("optim/").rpartition("/")
                moments.setdefault(fqn, {})[key] = t
        groups = [dict(g) for g in extra.get("param_groups") or [{}]]
        groups[0]["params"] = params
        for g in groups[1:]:
            g["params"] = []
        state["optimizer"] = {"state": moments, "param_groups": groups}
    state["stalwart"] = {"rng": {k.removeprefix("rng/"): t for k, t in tensors.items()
                                 if k.startswith("rng/")}}
    by_id = {id(t): name for name, t in tensors.items()}
    extra[NATIVE_NAMES] = {key: by_id[id(t)] for key, t in _tensor_leaves(state)
                           if id(t) in by_id}
    state["stalwart"]["extra"] = _json_tensor(extra)
    return state


def _is_optimizer_record(record: Any) -> bool:
    return (isinstance(record, dict) and set(record) == {"state", "param_groups"}
            and all("/" in n for g in record["param_groups"] for n in g.get("params", [])))


def _by_parameter_name(value: dict[str, Any]) -> dict[str, Any]:
    """Optimizer state keyed by the snapshot's '<module>/<param>' names, as torch.optim
    keyed by parameter name: the model's parameters by their own names, another
    registered module's as '<module>.<param>'."""
    def fqn(name: str) -> str:
        module, _, param = name.partition("/")
        return param if module == "model" else f"{module}.{param}"

    return {"state": {fqn(n): s for n, s in value["state"].items()},
            "param_groups": [{**g, "params": [fqn(n) for n in g["params"]]}
                             for g in value["param_groups"]]}


def _tensor_leaves(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(DCP key, tensor) of every tensor in a nested state: DCP joins the path with '.'."""
    import torch

    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _tensor_leaves(v, (*path, str(k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _tensor_leaves(v, (*path, str(i)))
    elif isinstance(value, tuple):  # DCP stores a tuple whole, pickled: no tensors there
        if any(True for _ in _tensor_leaves(list(value))):
            raise InteropError(f"state entry {'.'.join(path)!r} holds tensors in a tuple, "
                               "which a DCP checkpoint keeps only pickled; export it with "
                               "--format state_dict")
    elif torch.is_tensor(value):
        yield ".".join(path), value


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns that no process group exists; one process is what export/import want."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def load(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a torch.save file (weights_only) or a DCP directory, by flat '/' name."""
    if path.is_dir():
        return _load_dcp(path)
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0][:200]
        raise InteropError(
            f"{path} holds Python objects besides tensors ({first}); stalwart import loads "
            "only with torch.load(weights_only=True). Re-save it as a dict of tensors, e.g. "
            "torch.save(model.state_dict(), PATH)") from None
    if not isinstance(obj, Mapping):
        raise InteropError(f"{path} holds a {type(obj).__name__}, not a dict of tensors")
    return _flatten(obj, path)


def _flatten(obj: Mapping[str, Any], path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    import torch

    out: dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, path, name + "/"))
        elif torch.is_tensor(value):
            out[name] = value
        else:
            raise InteropError(f"{path}: entry {name!r} is a {type(value).__name__}, not a "
                               "tensor; keep only tensors in the checkpoint")
    return out


# Plain data constructors DCP's index also names (a layout by name, the checkpoint's path).
_SAFE_GLOBALS = {("collections", "OrderedDict"), ("builtins", "set"),
                 ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                 ("pathlib", "PurePosixPath"),
                 ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP writes its index as a pickle; allow only DCP's metadata classes and torch types."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in ("torch.distributed.checkpoint.metadata", "torch"):
            found = super().find_class(module, name)
            # The dataclasses and enums metadata defines build plain records; what it only
            # imports (Enum, whose call makes classes, typing's Any) is not among them.
            defined = isinstance(found, type) and getattr(found, "__module__", "") == module
            safe = (defined and module != "torch") or isinstance(
                found, torch.dtype | torch.layout | torch.memory_format) or found is torch.Size
            if safe:
                return found
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def _load_dcp(path: Path) -> dict[str, torch.Tensor]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    reader = SafeReader(str(path))
    try:
        metadata = reader.read_metadata()
    except (pickle.UnpicklingError, FileNotFoundError) as exc:
        raise InteropError(f"{path} is not a DCP checkpoint stalwart can read safely: "
                           f"{exc}") from None
    out = {}
    for name, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue  # plain values (optimizer hyperparameters) stay pickled: never loaded
        out[name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    if not out:
        raise InteropError(f"{path} holds no tensors")
    with _single_process():
        dcp.load(out, storage_reader=reader, no_dist=True)
    return _snapshot_names(out)


def _snapshot_names(loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's tensors under the snapshot's names: a Stalwart export says
    them in its record; a foreign one in torch-native layout maps its optimizer's
    per-parameter state (optimizer.state.<param>.<key>) to optim/<param>/<key>."""
    native_extra = loaded.get("stalwart.extra")
    if native_extra is not None:
        extra = json.loads(bytes(native_extra.numpy()).decode())
        names = extra.pop(NATIVE_NAMES, {})
        out = {names[k]: t for k, t in loaded.items() if k in names}
        out[EXTRA_KEY] = _json_tensor(extra)
        return out
    out = {}
    for key, t in loaded.items():
        if key.startswith("optimizer.state."):
            param, _, moment = key.removeprefix("optimizer.state.").rpartition(".")
            out[f"optim/{param}/{moment}"] = t
        else:
            out[key] = t
    return out


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
