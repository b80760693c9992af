"""Re-planning after devices fail or join: the new (dp, pp, tp) layout, its partition, and
the layers each rank must receive.

Ranks are numbered as the client numbers them (tp fastest, then dp, pp slowest). TP
degree stays as it was (TP groups live inside a node); DP replicas and pipeline stages
are what shrink or grow. The global batch stays fixed: fewer replicas mean more
accumulation, so the predicted step time counts the micro-batches each replica runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from stalwart.core.partition import Partition, partition

__all__ = ["Layout", "Replan", "replan"]

# Candidate step times within this fraction count as equal; fewer moved layers then win.
_TIE = 1e-9


@dataclass(frozen=True)
class Layout:
    """A running plan: degrees, stage bounds and the device of each rank."""

    dp: int
    pp: int
    tp: int
    stages: tuple[tuple[int, int], ...]
    devices: tuple[str, ...]
    """devices[rank]: the device (any stable name, e.g. "node3/gpu1") running that rank."""

    def __post_init__(self) -> None:
        if len(self.devices) != self.dp * self.pp * self.tp:
            raise ValueError(f"{len(self.devices)} devices for dp*pp*tp = "
                             f"{self.dp * self.pp * self.tp} ranks: give one device per rank")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError("a device appears twice in the plan: each rank needs its own")
        if len(self.stages) != self.pp:
            raise ValueError(f"{len(self.stages)} stage bounds for pp={self.pp}")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) of `rank`."""
        return ((rank // self.tp) % self.dp, rank // (self.tp * self.dp), rank % self.tp)

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def holdings(self) -> dict[str, tuple[int, set[int]]]:
        """device -> (tp index, layers whose tp-th shard it holds)."""
        out = {}
        for rank, device in enumerate(self.devices):
            _, stage, t = self.coords(rank)
            first, last = self.stages[stage]
            out[device] = (t, set(range(first, last + 1)))
        return out

    def to_json(self) -> dict:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp,
                "stages": [list(s) for s in self.stages], "devices": list(self.devices)}


@dataclass
class Replan:
    """The chosen layout and what must move to reach it."""

    layout: Layout
    partition: Partition
    predicted_step: float
    """(micro-batches per replica + pp - 1) x bottleneck, in the unit of the costs."""
    receive: dict[int, list[int]]
    """new rank -> layers (its tp shard) that its device does not hold yet."""
    sources: dict[int, list[str]]
    """layer -> surviving devices that hold a shard of it (peers to fetch from)."""
    layers_moved: int
    considered: list[dict] = field(default_factory=list)
    """Every (dp, pp) tried with its predicted step and layers moved."""

    def to_json(self) -> dict:
        return {"layout": self.layout.to_json(), "partition": self.partition.to_json(),
                "predicted_step": self.predicted_step, "layers_moved": self.layers_moved,
                "receive": {str(r): v for r, v in self.receive.items()},
                "considered": self.considered}


def replan(layout: Layout, costs: Sequence[float], *, failed: Iterable[str] = (),
           added: Iterable[str] = (), speeds: Mapping[str, float] | None = None,
           microbatches: int | None = None, mem: Sequence[float] | None = None,
           act: Sequence[float] | None = None, mem_cap: float | None = None,
           pp_options: Iterable[int] | None = None) -> Replan:
    """The fastest layout on the surviving and added devices, moving the fewest layers
    among equally fast ones.

    costs: per-layer cost (seconds per micro-batch, or FLOPs).
    speeds: device -> speed factor (default 1); a stage runs at its slowest TP member.
    microbatches: micro-batches per optimizer step over the whole job (the global batch);
        default: the current dp x pp, i.e. a full 1F1B pipeline per replica.
    mem, act, mem_cap: as for `partition` (static bytes, activation bytes per layer, cap).
    pp_options: pipeline depths to consider (default: every depth the devices allow).
    """
    failed, added = set(failed), list(added)
    unknown = failed - set(layout.devices)
    if unknown:
        raise ValueError(f"failed devices {sorted(unknown)} are not in the plan")
    clash = set(added) & set(layout.devices) - failed
    if clash:
        raise ValueError(f"added devices {sorted(clash)} are already running ranks")
    speeds = dict(speeds or {})
    total_mb = microbatches or layout.dp * layout.pp
    pool = _pool(layout, failed, added)
    held = layout.holdings()
    tp = layout.tp
    if len(pool) < tp:
        raise ValueError(f"{len(pool)} devices survive but one tensor-parallel group needs "
                         f"{tp}: add devices or restart with a smaller tp")
    best: Replan | None = None
    considered = []
    errors = []
    depths = range(1, min(len(costs), len(pool) // tp) + 1)
    if pp_options is not None:
        depths = [d for d in depths if d in set(pp_options)]
    for pp in depths:
        for dp in range(1, len(pool) // (tp * pp) + 1):
            if total_mb % dp:
                continue
            devices = pool[:dp * pp * tp]
            cand = Layout(dp, pp, tp, tuple((0, 0) for _ in range(pp)), tuple(devices))
            stage_speed = [min(speeds.get(cand.devices[cand.rank_of(d, s, t)], 1.0)
                               for d in range(dp) for t in range(tp)) for s in range(pp)]
            move_costs = [[float(sum(_lacks(held, cand.devices[cand.rank_of(d, s, t)], t, i)
                                     for d in range(dp) for t in range(tp)))
                           for i in range(len(costs))] for s in range(pp)]
            try:
                part = partition(costs, pp, stage_speed, mem=mem, act=act, mem_cap=mem_cap,
                                 micro_batches=total_mb // dp, move_costs=move_costs)
            except ValueError as exc:
                errors.append(f"dp={dp} pp={pp}: {exc}")
                continue
            step = (total_mb // dp + pp - 1) * part.bottleneck
            moved = int(sum(move_costs[j][i] for i, j in enumerate(part.owners())))
            considered.append({"dp": dp, "pp": pp, "predicted_step": step,
                               "layers_moved": moved})
            if best is None or step < best.predicted_step * (1 - _TIE) or (
                    step <= best.predicted_step * (1 + _TIE) and moved < best.layers_moved):
                chosen = Layout(dp, pp, tp, part.stages, tuple(devices))
                best = Replan(chosen, part, step, {}, {}, moved)
    if best is None:
        detail = "; ".join(errors[-3:])
        raise ValueError(f"no layout of the {len(pool)} surviving devices can hold the model: "
                         f"{detail}")
    best.considered = considered
    best.receive, best.sources = _transfers(best.layout, held, failed, len(costs))
    return best


def _pool(layout: Layout, failed: set[str], added: list[str]) -> list[str]:
    """Surviving devices, whole replicas first and each in pipeline order, then the added
    ones: taking a prefix keeps intact replicas intact and devices near their stage."""
    replicas = []
    for d in range(layout.dp):
        devs = [layout.devices[layout.rank_of(d, s, t)]
                for s in range(layout.pp) for t in range(layout.tp)]
        alive = [x for x in devs if x not in failed]
        replicas.append((len(alive) < len(devs), d, alive))
    replicas.sort()
    return [x for _, _, alive in replicas for x in alive] + added


def _lacks(held: dict[str, tuple[int, set[int]]], device: str, tp_index: int,
           layer: int) -> bool:
    have = held.get(device)
    return have is None or have[0] != tp_index or layer not in have[1]


def _transfers(layout: Layout, held: dict[str, tuple[int, set[int]]], failed: set[str],
               n_layers: int) -> tuple[dict[int, list[int]], dict[int, list[str]]]:
    receive = {}
    for rank, device in enumerate(layout.devices):
        _, stage, t = layout.coords(rank)
        first, last = layout.stages[stage]
        need = [i for i in range(first, last + 1) if _lacks(held, device, t, i)]
        if need:
            receive[rank] = need
    sources = {i: sorted(dev for dev, (_, layers) in held.items()
                         if i in layers and dev not in failed) for i in range(n_layers)}
    return receive, sources

