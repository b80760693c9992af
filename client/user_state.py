"""The user's registered state as named tensors plus one JSON record, and back.

Every registered object has `state_dict()` / `load_state_dict()`. Tensors travel to the
daemon as raw bytes (`<key>/<path>`); everything else must be a plain value (number,
string, bool, None, list, tuple, dict) and goes into the JSON record. Optimizer state is
keyed by parameter name rather than by position, so a layout change needs no renaming.
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch

from stalwart.client import host_rng
from stalwart.client.record_json import Frozen
from stalwart.client.state_layout import StateTensor, dtype_to_proto, same_layout
from stalwart.v1 import manifest_pb2

__all__ = ["StateError", "StateRegistry"]

STATE_FORMAT = 2
_TENSOR, _TUPLE = "__stalwart_tensor__", "__stalwart_tuple__"
_PLAIN = (bool, int, float, str, type(None))


class StateError(TypeError):
    """Registered state that Stalwart cannot capture or restore; the message names it."""


class StateRegistry:
    """The named objects a job snapshots every step (model, optimizer, scheduler, ...)."""

    def __init__(self, objects: Mapping[str, Any]) -> None:
        objects = {key: host_rng.GeneratorState(obj) if host_rng.GeneratorState.takes(obj)
                   else obj for key, obj in objects.items()}
        for key, obj in objects.items():
            if not key or "/" in key:
                raise StateError(f"state name {key!r} must be non-empty and contain no '/'")
            if isinstance(obj, random.SystemRandom):
                raise StateError(f"registered state {key!r} is a random.SystemRandom: it draws "
                                 "from the operating system and has no state to restore; use "
                                 "random.Random(seed)")
            for method in ("state_dict", "load_state_dict"):
                if not callable(getattr(obj, method, None)):
                    raise StateError(f"registered state {key!r} ({type(obj).__name__}) has no "
                                     f"{method}(); register objects with state_dict() and "
                                     "load_state_dict() (or a random generator: "
                                     f"{host_rng.GeneratorState.KINDS}), or wrap the "
                                     "value in one")
        self.objects = dict(objects)
        for key, module in self.modules():
            lazy = [name for name, t in (*module.named_parameters(), *module.named_buffers())
                    if torch.nn.parameter.is_lazy(t)]
            if lazy:
                raise StateError(
                    f"registered module {key!r} has {len(lazy)} uninitialized tensors "
                    f"({', '.join(lazy[:3])}{', ...' if len(lazy) > 3 else ''}: a lazy "
                    "module's); run one forward with a batch of the real shape before "
                    "handing it over, and create the optimizer after that forward")
        self._names = self._param_names()
        # A registered module's parameters change only in optimizer.step(): their copy
        # runs beside the next step. Every other tensor (a module's buffers, which the
        # next forward updates; another object's) is copied at the capture (`staged`).
        self._param_paths = frozenset(
            f"{key}/{name}" for key, module in self.modules()
            for name, _ in module.named_parameters(remove_duplicate=False))
        self._layout: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None
        self._checked: list[StateTensor] = []  # the tensors whose layout was checked last
        self._reuse = _Reuse()

    def _param_names(self) -> dict[int, str]:
        """id(parameter) -> '<module key>/<parameter name>' over the registered modules."""
        names: dict[int, str] = {}
        for key, obj in self.objects.items():
            if isinstance(obj, torch.nn.Module):
                for name, p in obj.named_parameters():
                    names.setdefault(id(p), f"{key}/{name}")
        return names

    def modules(self) -> Iterator[tuple[str, torch.nn.Module]]:
        for key, obj in self.objects.items():
            if isinstance(obj, torch.nn.Module):
                yield key, obj

    def optimizers(self) -> Iterator[tuple[str, torch.optim.Optimizer]]:
        for key, obj in self.objects.items():
            if isinstance(obj, torch.optim.Optimizer):
                yield key, obj

    # capture ---------------------------------------------------------------------

    def capture(self, step: int) -> tuple[list[StateTensor], dict[str, Any]]:
        """This rank's state at `step`: tensors to capture (live references, no copy)
        and the JSON-able rest."""
        tensors: list[StateTensor] = []
        record: dict[str, Any] = {}
        for key, obj in self.objects.items():
            if isinstance(obj, torch.optim.Optimizer):
                record[key] = self._optimizer_state(key, obj, tensors)
            else:
                record[key] = _flatten(obj.state_dict(), key, tensors, reuse=self._reuse,
                                       settled=self._param_paths)
        self._reuse.turn()
        tensors.append(StateTensor("rng/cpu", torch.get_rng_state()))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            tensors.append(StateTensor("rng/cuda", torch.cuda.get_rng_state()))
        tensors.extend(StateTensor(f"rng/{k}", t) for k, t in host_rng.states().items())
        self._check_layout(tensors)
        return tensors, {"format": STATE_FORMAT, "step": step, "objects": record}

    def _optimizer_state(self, key: str, opt: torch.optim.Optimizer,
                         out: list[StateTensor]) -> dict[str, Any]:
        sd = opt.state_dict()
        order = [p for g in opt.param_groups for p in g["params"]]
        names = []
        for i, p in enumerate(order):
            name = self._names.get(id(p))
            if name is None:
                raise StateError(f"optimizer {key!r} updates a parameter (position {i}, shape "
                                 f"{tuple(p.shape)}) of no registered module; register the "
                                 "model that owns it")
            names.append(name)
        state = self._reuse.whole(key, sd["state"], names, out)
        if state is None:
            start = len(out)
            flat = {names[i]: _flatten(s, f"{key}/{names[i]}", out, reuse=self._reuse)
                    for i, s in sd["state"].items()}
            state = self._reuse.keep_whole(key, sd["state"], names, flat, out[start:]) or flat
        groups = []
        for index, g in enumerate(sd["param_groups"]):
            # A group's hyperparameters may be tensors (`lr=torch.tensor(...)`, as for a
            # compiled or capturable step); the scheduler changes them in place after
            # optimizer.step(), so they are copied at the capture (`settled` names none).
            rest = {k: v for k, v in g.items() if k != "params"}
            groups.append({"params": [names[i] for i in g["params"]],
                           **_flatten(rest, f"{key}/param_groups/{index}", out,
                                      settled=frozenset())})
        return {"state": state, "param_groups": groups}

    def _check_layout(self, tensors: list[StateTensor]) -> None:
        """The tensors of one job keep their names, dtypes and shapes from step to step
        (optimizer state appears at the first step and may not change after)."""
        if same_layout(tensors, self._checked):
            # The usual step: checked when it first appeared. The tensors of now are kept,
            # not the first ones: those may have been replaced since (a restore loads new
            # optimizer state) and must not be kept alive.
            self._checked = list(tensors)
            return
        layout = [(t.name, t.tensor.dtype, tuple(t.tensor.shape)) for t in tensors]
        for name, dtype, _ in layout:
            try:
                dtype_to_proto(dtype)
            except TypeError:
                raise StateError(f"state tensor {name!r} has dtype {dtype}, which Stalwart "
                                 "cannot snapshot; keep it in a supported dtype (float32/16/64, "
                                 "bfloat16, int8-64, uint8, bool)") from None
        if self._layout is not None and layout != self._layout:
            before = {n: (d, s) for n, d, s in self._layout}
            for name, dtype, shape in layout:
                if name in before and before[name] != (dtype, shape):
                    raise StateError(
                        f"state tensor {name!r} changed from {before[name][1]} "
                        f"{before[name][0]} to {shape} {dtype} between steps; Stalwart "
                        "snapshots state whose shapes stay fixed once the first step is taken")
        self._layout, self._checked = layout, list(tensors)

    # restore ---------------------------------------------------------------------

    def load(self, tensors: Mapping[str, torch.Tensor], extra: Mapping[str, Any]) -> int:
        """Put a captured state back into the registered objects, bitwise; returns its step."""
        if extra.get("format") != STATE_FORMAT:
            raise StateError(f"state format {extra.get('format')} is not {STATE_FORMAT}; "
                             "this client cannot read it (was it captured by another program?)")
        record = extra["objects"]
        missing = sorted(set(self.objects) - set(record))
        if missing:
            raise StateError(f"the committed step holds no state for {missing}; register the "
                             f"same objects as the run that captured it ({sorted(record)})")
        for key, obj in self.objects.items():
            if isinstance(obj, torch.optim.Optimizer):
                obj.load_state_dict(self._optimizer_dict(key, obj, record[key], tensors))
            else:
                obj.load_state_dict(_unflatten(record[key], tensors))
            if isinstance(obj, torch.amp.GradScaler):
                # What unscale_ noted of the step a failure cut short (before update()
                # cleared it) is not in its state_dict; the restored step starts clean.
                obj._per_optimizer_states.clear()
        torch.set_rng_state(tensors["rng/cpu"])
        if "rng/cuda" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["rng/cuda"])
        host_rng.load({k.removeprefix("rng/"): t for k, t in tensors.items()
                       if k.startswith("rng/")})
        return int(extra["step"])

    def _optimizer_dict(self, key: str, opt: torch.optim.Optimizer, saved: dict[str, Any],
                        tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        index = {self._names[id(p)]: i for i, p in
                 enumerate(p for g in opt.param_groups for p in g["params"])}
        unknown = sorted(set(saved["state"]) - set(index))
        if unknown:
            raise StateError(f"optimizer {key!r}: the committed state has parameters "
                             f"{unknown[:3]} that this model does not")
        state = {index[name]: _unflatten(s, tensors) for name, s in saved["state"].items()}
        groups = []
        for g in saved["param_groups"]:
            rest = _unflatten({k: v for k, v in g.items() if k != "params"}, tensors)
            groups.append({**rest, "params": [index[n] for n in g["params"]]})
        return {"state": state, "param_groups": groups}

    # hints -----------------------------------------------------------------------

    def adamw_hints(self) -> list[manifest_pb2.AdamWHint]:
        """How Adam/AdamW moved each parameter in the last step (for smaller deltas)."""
        hints = []
        for key, opt in self.optimizers():
            if type(opt) not in (torch.optim.AdamW, torch.optim.Adam):
                continue
            decoupled = isinstance(opt, torch.optim.AdamW)
            for group in opt.param_groups:
                if group.get("amsgrad") or group.get("maximize"):
                    continue
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    state = opt.state.get(p, {})
                    name = self._names.get(id(p))
                    if name is None or "step" not in state:
                        continue
                    hints.append(manifest_pb2.AdamWHint(
                        param=name, exp_avg=f"{key}/{name}/exp_avg",
                        exp_avg_sq=f"{key}/{name}/exp_avg_sq", lr=float(group["lr"]),
                        beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                        weight_decay=float(group["weight_decay"]) if decoupled else 0.0,
                        step=int(state["step"])))
        return hints


class _Flattened(NamedTuple):
    keys: tuple[Any, ...]
    values: tuple[torch.Tensor, ...]
    record: Frozen
    tensors: list[StateTensor]
    parts: dict[str, _Flattened] | None = None  # a whole state's, by path


class _Reuse:
    """The last capture's flattening of each mapping of tensors, by path. The usual step
    hands over the same tensors under the same keys: an optimizer's moments themselves,
    a module's parameters and buffers as new detached views of the same memory. Their
    records and StateTensors are then reused, not rebuilt: a reused StateTensor is a view
    of the same memory as the one handed over now, so it reads today's values."""

    def __init__(self) -> None:
        self._last: dict[str, _Flattened] = {}
        self._now: dict[str, _Flattened] = {}

    def get(self, path: str, value: Mapping[Any, Any], out: list[StateTensor]
            ) -> Frozen | None:
        hit = self._last.get(path)
        if hit is None or len(value) != len(hit.values) or tuple(value) != hit.keys or \
                not _all_same(value.values(), hit.values):
            return None
        out.extend(hit.tensors)
        self._now[path] = hit
        return hit.record

    def keep(self, path: str, value: Mapping[Any, torch.Tensor], record: Frozen,
             tensors: list[StateTensor]) -> None:
        self._now[path] = _Flattened(tuple(value), tuple(value.values()), record, tensors)

    def whole(self, key: str, state: Mapping[int, Mapping[str, Any]], names: list[str],
              out: list[StateTensor]) -> Frozen | None:
        """Optimizer `key`'s whole per-parameter state at once: the last capture's record
        where it holds the very same tensors under the same names and keys (an optimizer
        updates its state in place), checked in one pass rather than parameter by
        parameter."""
        hit = self._last.get(f"{key}/state")  # no clash: a parameter's name has a '/'
        if hit is None or not _all_mappings(state) or hit.keys != _state_keys(state, names) or \
                not _all_same(_state_values(state), hit.values):
            return None
        out.extend(hit.tensors)
        self._now[f"{key}/state"] = hit
        self._now.update(hit.parts or {})  # kept for a capture where one of them changed
        return hit.record

    def keep_whole(self, key: str, state: Mapping[int, Mapping[str, Any]], names: list[str],
                   record: dict[str, Any], tensors: list[StateTensor]) -> Frozen | None:
        """Keep optimizer `key`'s state flattened for `whole`, where it holds only tensors
        (a value of another kind may change in place: it is flattened at each capture)."""
        if not _all_mappings(state):
            return None  # a parameter's state that is a tensor or a list: flattened as such
        values = _state_values(state)
        if not all(isinstance(v, torch.Tensor) for v in values):
            return None
        frozen = Frozen(record)
        parts = {path: self._now[path] for path in (f"{key}/{name}" for name in record)
                 if path in self._now}
        self._now[f"{key}/state"] = _Flattened(_state_keys(state, names), values, frozen,
                                               tensors, parts)
        return frozen

    def turn(self) -> None:
        """One capture is done: what it did not use is forgotten (and freed)."""
        self._last, self._now = self._now, {}


def _all_mappings(state: Mapping[int, Any]) -> bool:
    return all(isinstance(s, Mapping) for s in state.values())


def _state_keys(state: Mapping[int, Mapping[str, Any]], names: list[str]
                ) -> tuple[Any, ...]:
    return tuple((i, names[i], tuple(s)) for i, s in state.items())


def _state_values(state: Mapping[int, Mapping[str, Any]]) -> tuple[Any, ...]:
    return tuple(v for s in state.values() for v in s.values())


def _all_same(now: Any, last: tuple[Any, ...]) -> bool:
    """Each of `now` reads what the same place of `last` did: the same objects (one
    check for all), else views of the same memory one by one."""
    now = tuple(now)
    return all(map(operator.is_, now, last)) or all(map(_same_view, now, last))


def _same_view(now: Any, last: torch.Tensor) -> bool:
    """`now` reads what `last` (kept alive since the last capture, so its memory cannot
    have been handed to another tensor) reads: the same tensor, or a view of the same
    address with the same dtype, shape and strides."""
    if now is last:
        return True
    return (type(now) is type(last) and now.layout == torch.strided == last.layout
            and now.data_ptr() == last.data_ptr() and now.dtype == last.dtype
            and now.shape == last.shape and now.stride() == last.stride()
            and now.device == last.device)


def _flatten(value: Any, path: str, out: list[StateTensor], *, reuse: _Reuse | None = None,
             settled: frozenset[str] | None = None) -> Any:
    """A JSON-able copy of `value` with each tensor moved to `out` under its path.
    With `settled` (the paths of tensors only optimizer.step() changes), every tensor at
    another path is `staged`: copied at the capture, not beside the next step."""
    if isinstance(value, torch.Tensor):
        # state_dict() hands out detached tensors: only one that tracks gradients needs it.
        out.append(StateTensor(path, value.detach() if value.requires_grad else value,
                               staged=settled is not None and path not in settled))
        return {_TENSOR: path}
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__stalwart_float__": repr(value)}
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, dict | Mapping):
        if reuse is not None and (same := reuse.get(path, value, out)) is not None:
            return same
        start, result = len(out), {}
        for k, v in value.items():
            if not isinstance(k, str | int):
                raise StateError(f"{path!r} has a key {k!r} of type {type(k).__name__}; "
                                 "state keys must be strings or integers")
            result[str(k) if isinstance(k, str) else f"__int__{k}"] = _flatten(
                v, f"{path}/{k}", out, reuse=reuse, settled=settled)
        if reuse is not None and all(isinstance(v, torch.Tensor) for v in value.values()):
            result = Frozen(result)  # reused as it is while the same tensors are
            reuse.keep(path, value, result, out[start:])
        return result
    if isinstance(value, list | tuple):
        items = [_flatten(v, f"{path}/{i}", out, settled=settled) for i, v in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    raise StateError(f"{path!r} is a {type(value).__name__}, which Stalwart cannot capture: "
                     "state_dict() may hold tensors and plain values (numbers, strings, bools, "
                     "None, lists, tuples, dicts); keep other objects out of it")


def _unflatten(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value:
            name = value[_TENSOR]
            if name not in tensors:
                raise StateError(f"the committed step lacks tensor {name!r}")
            return tensors[name]
        if _TUPLE in value:
            return tuple(_unflatten(v, tensors) for v in value[_TUPLE])
        if "__stalwart_float__" in value:
            return float(value["__stalwart_float__"])
        return {(int(k[7:]) if k.startswith("__int__") else k): _unflatten(v, tensors)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    return value
