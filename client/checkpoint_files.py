"""Checkpoint files of the standard PyTorch kinds, as `stalwart export` writes and
`stalwart import` reads them: a torch.save dict of tensors (loaded weights_only), or a
torch.distributed.checkpoint directory in the layout torch users give a job (its
pickled index read by an unpickler that builds DCP's metadata records and nothing else).
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

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


def json_tensor(value: Any) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(json.dumps(value, sort_keys=True).encode()),
                            dtype=torch.uint8)


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
        names = [n.removeprefix("model/") for n in tensors if n.startswith("model/")]
        state.update({n: tensors[f"model/{n}"] for n in names})
        moments: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            if name.startswith("optim/"):
                fqn, _, key = name.removeprefix("optim/").rpartition("/")
                moments.setdefault(fqn, {})[key] = t
        groups = [dict(g) for g in extra.get("param_groups") or [{}]]
        groups[0]["params"] = _trained(names, moments, extra)
        for g in groups[1:]:
            g["params"] = []
        state["optimizer"] = {"state": moments, "param_groups": groups}
    state["stalwart"] = {"rng": {k.removeprefix("rng/"): t for k, t in tensors.items()
                                 if k.startswith("rng/")}}
    by_id = {id(t): name for name, t in tensors.items()}
    extra[NATIVE_NAMES] = {key: by_id[id(t)] for key, t in _tensor_leaves(state)
                           if id(t) in by_id}
    state["stalwart"]["extra"] = json_tensor(extra)
    return state


def _trained(names: list[str], moments: Mapping[str, Any], extra: Mapping[str, Any]) -> list[str]:
    """What the 3D loop's AdamW holds: parameters (the layout's shard_dims names them;
    buffers are not), less the frozen ones, which never step and so have no moments (a
    step with no moments at all is one no parameter has taken yet: every one is kept)."""
    parameters = extra.get("layout", {}).get("shard_dims") or {}
    params = [n for n in names if n in parameters] if parameters else names
    return [n for n in params if n in moments] if moments else params


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
        out[EXTRA_KEY] = json_tensor(extra)
        return out
    out = {}
    for key, t in loaded.items():
        if key.startswith("optimizer.state."):
            param, _, moment = key.removeprefix("optimizer.state.").rpartition(".")
            out[f"optim/{param}/{moment}"] = t
        else:
            out[key] = t
    return out
