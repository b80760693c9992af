"""A Trainer's full state as named tensors plus a small JSON record, and back.

Names are layout-independent (`model/layers.3.attn.qkv.weight`,
`optim/layers.3.attn.qkv.weight/exp_avg`, `rng/cpu`); TP shards carry their global
shape and offsets, so the same record can be restored into this layout exactly or
resharded into another one.
"""

from __future__ import annotations

from typing import Any

import torch

from stalwart.client import host_rng
from stalwart.client.state_layout import StateTensor
from stalwart.client.trainer import Trainer
from stalwart.v1 import manifest_pb2

STATE_FORMAT = 1


def _layer_of(name: str) -> int:
    return int(name.split(".", 2)[1])


def _shard_info(trainer: Trainer, name: str, t: torch.Tensor
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global shape and this rank's offsets of parameter `name` (and its optimizer state)."""
    dim = trainer.stage.shard_dim(name)
    tp = trainer.dims.layout.tp
    if dim is None or tp == 1:
        return tuple(t.shape), (0,) * t.dim()
    shape, offsets = list(t.shape), [0] * t.dim()
    offsets[dim] = shape[dim] * trainer.dims.my.tp
    shape[dim] *= tp
    return tuple(shape), tuple(offsets)


def state_tensors(trainer: Trainer) -> tuple[list[StateTensor], dict[str, Any]]:
    """This rank's state: tensors to capture and the JSON-able rest."""
    out: list[StateTensor] = []
    opt = trainer.optimizer
    for name, p in trainer.stage.named_parameters():
        gshape, offs = _shard_info(trainer, name, p)
        layer = _layer_of(name)
        out.append(StateTensor(f"model/{name}", p.detach(), layer, gshape, offs))
        for key, value in sorted(opt.state.get(p, {}).items()):
            if not torch.is_tensor(value):
                continue
            if value.shape == p.shape:
                out.append(StateTensor(f"optim/{name}/{key}", value, layer, gshape, offs))
            else:  # per-parameter scalars such as Adam's step count
                out.append(StateTensor(f"optim/{name}/{key}", value, layer))
    for name in trainer.buffer_names:  # the next forward updates them: `staged`
        b = trainer.stage.get_buffer(name)
        gshape, offs = _shard_info(trainer, name, b)
        out.append(StateTensor(f"model/{name}", b, _layer_of(name), gshape, offs, staged=True))
    out.append(StateTensor("rng/cpu", torch.get_rng_state()))
    if trainer.device.type == "cuda":
        out.append(StateTensor("rng/cuda", torch.cuda.get_rng_state(trainer.device)))
    out.extend(StateTensor(f"rng/{k}", t) for k, t in host_rng.states().items())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    extra = {"format": STATE_FORMAT, "step": trainer.step_count,
             "scaler": trainer.scaler.state_dict(), "data": trainer.data.state_dict(),
             "param_groups": groups, "layout": trainer.layout()}
    return out, extra


def adamw_hints(trainer: Trainer) -> list[manifest_pb2.AdamWHint]:
    """How AdamW moved each parameter in the last step, named as in `state_tensors`."""
    opt, hints = trainer.optimizer, []
    if not isinstance(opt, torch.optim.AdamW):
        return hints
    names = {id(p): n for n, p in trainer.stage.named_parameters()}
    for group in opt.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            state = opt.state.get(p, {})
            name = names.get(id(p))
            if name is None or "step" not in state:
                continue
            hints.append(manifest_pb2.AdamWHint(
                param=f"model/{name}", exp_avg=f"optim/{name}/exp_avg",
                exp_avg_sq=f"optim/{name}/exp_avg_sq", lr=float(group["lr"]), beta1=beta1,
                beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                step=int(state["step"])))
    return hints


def load_state(trainer: Trainer, tensors: dict[str, torch.Tensor], extra: dict[str, Any]) -> None:
    """Put a captured state back into a Trainer of the same layout, bitwise."""
    if extra.get("format") != STATE_FORMAT:
        raise ValueError(f"state format {extra.get('format')} is not {STATE_FORMAT}; "
                         "this client cannot read it")
    names = [n for n, _ in trainer.stage.named_parameters()]
    wanted = [*names, *trainer.buffer_names]
    missing = [n for n in wanted if f"model/{n}" not in tensors]
    if missing:
        raise ValueError(f"restored state lacks parameters or buffers {missing[:3]}... for "
                         f"stage {trainer.dims.my.pp}; was it captured with another "
                         "partition or another model?")
    model = {n: tensors[f"model/{n}"] for n in wanted}
    opt_state: dict[int, dict[str, Any]] = {}
    trained = trainer.param_names  # the optimizer's parameters, in its order
    for i, n in enumerate(trained):
        prefix = f"optim/{n}/"
        entry = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if entry:
            opt_state[i] = entry
    groups, start = [], 0
    for saved, live in zip(extra["param_groups"], trainer.optimizer.param_groups, strict=True):
        count = len(live["params"])
        groups.append({**saved, "params": list(range(start, start + count))})
        start += count
    state = {
        "step": extra["step"], "model": model,
        "optimizer": {"state": {trained[i]: s for i, s in opt_state.items()},
                      "param_groups": groups},
        "scaler": extra["scaler"], "data": extra["data"],
        "rng": {k.removeprefix("rng/"): t for k, t in tensors.items() if k.startswith("rng/")},
    }
    trainer.load_state_dict(state)
