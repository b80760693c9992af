"""The (dp, pp, tp) grid of a job: each rank's coordinates and who shares a group with whom.

Ranks are numbered tp fastest, then dp, pp slowest: rank = (pp * dp_size + dp) * tp_size + tp.
The client's process groups, the planners and the coordinator all number them this way.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from stalwart.v1 import common_pb2

__all__ = ["AXES", "Coord", "Layout"]

AXES = ("dp", "pp", "tp")
"""The parallel axes, in the order Coord and `Layout.rank_of` take them."""


@dataclass(frozen=True)
class Coord:
    """A rank's position in the grid; `rank` is its global rank (the pure twin of
    `stalwart.v1.RankCoord`)."""

    rank: int
    dp: int
    pp: int
    tp: int

    def to_proto(self) -> common_pb2.RankCoord:
        return common_pb2.RankCoord(rank=self.rank, dp=self.dp, pp=self.pp, tp=self.tp)

    @classmethod
    def from_proto(cls, msg: common_pb2.RankCoord) -> Coord:
        return cls(msg.rank, msg.dp, msg.pp, msg.tp)


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of a generation and what the training loop needs to run them
    (the pure twin of `stalwart.v1.ParallelLayout`)."""

    dp: int = 1
    """Data-parallel replicas (each sees a different slice of the global batch)."""
    pp: int = 1
    """Pipeline stages (each holds a contiguous range of layers)."""
    tp: int = 1
    """Tensor-parallel ranks (each holds a slice of every block's heads and FFN)."""
    stages: tuple[tuple[int, int], ...] = ()
    """First and last layer (inclusive) of each stage; empty: an even split."""
    schedule: str = "1f1b"
    """Pipeline schedule: "1f1b", "gpipe" or "interleaved"."""
    microbatches: int = 1
    """Micro-batches per optimizer step and pipeline."""
    grad_accum: int = 1
    """Accumulation rounds per optimizer step (the most any replica runs)."""
    microbatch_total: int = 0
    """Micro-batches per optimizer step over all replicas where they hold unequal shares
    (`replica_microbatches`); 0: each runs microbatches x grad_accum."""

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis}={getattr(self, axis)}: every parallel degree must "
                                 f"be >= 1 (dp={self.dp} pp={self.pp} tp={self.tp})")
        total = self.microbatch_total
        if total and not unequal_shares_fit(self.dp, self.pp, self.microbatches,
                                            self.grad_accum, total):
            raise ValueError(
                f"microbatch_total={total} needs pp=1, microbatches=1, at least one "
                f"micro-batch per replica and grad_accum the largest share "
                f"(dp={self.dp} pp={self.pp} microbatches={self.microbatches} "
                f"grad_accum={self.grad_accum})")

    @property
    def total_microbatches(self) -> int:
        """Micro-batches per optimizer step over all replicas."""
        return self.microbatch_total or self.dp * self.microbatches * self.grad_accum

    def replica_microbatches(self, dp: int) -> tuple[int, int]:
        """(first, count): the micro-batches of a step, in global batch order, that
        replica `dp` runs; the replicas' shares are consecutive and differ by at most one."""
        base, extra = divmod(self.total_microbatches, self.dp)
        return dp * base + min(dp, extra), base + (dp < extra)

    @property
    def world_size(self) -> int:
        """Ranks of the grid: dp * pp * tp."""
        return self.dp * self.pp * self.tp

    def coords(self, rank: int) -> Coord:
        """Grid position of global `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the dp={self.dp} pp={self.pp} "
                             f"tp={self.tp} world of {self.world_size} ranks")
        rest, tp = divmod(rank, self.tp)
        pp, dp = divmod(rest, self.dp)
        return Coord(rank, dp, pp, tp)

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        """Global rank at the coordinates (dp, pp, tp)."""
        if not (0 <= dp < self.dp and 0 <= pp < self.pp and 0 <= tp < self.tp):
            raise ValueError(f"coordinates dp={dp} pp={pp} tp={tp} are outside the "
                             f"{self.dp}x{self.pp}x{self.tp} grid")
        return (pp * self.dp + dp) * self.tp + tp

    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        """Ranks that share every coordinate with `rank` except `axis`, in `axis` order."""
        c = self.coords(rank)
        at = {"dp": c.dp, "pp": c.pp, "tp": c.tp}
        size = self._size(axis)
        return tuple(self.rank_of(**{**at, axis: i}) for i in range(size))

    # Layouts are immutable and hashable, so each axis' groups are computed once.
    @functools.cache  # noqa: B019
    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every group of `axis` (each as `group` gives it), ordered by its first rank."""
        self._size(axis)
        return tuple(self.group(r, axis) for r in range(self.world_size)
                     if getattr(self.coords(r), axis) == 0)

    @functools.cache  # noqa: B019
    def pp_pairs(self) -> tuple[tuple[int, int], ...]:
        """(sender, receiver) ranks of neighbouring stages, for every (dp, tp)."""
        return tuple(pair for g in self.groups("pp") for pair in itertools.pairwise(g))

    def _size(self, axis: str) -> int:
        if axis not in AXES:
            raise ValueError(f"axis {axis!r} is not a parallel axis; choose one of {AXES}")
        return getattr(self, axis)

    def to_proto(self) -> common_pb2.ParallelLayout:
        return common_pb2.ParallelLayout(
            dp=self.dp, pp=self.pp, tp=self.tp, schedule=self.schedule,
            microbatches=self.microbatches, grad_accum=self.grad_accum,
            microbatch_total=self.microbatch_total,
            stages=[common_pb2.StageBounds(first_layer=a, last_layer=b) for a, b in self.stages])

    @classmethod
    def from_proto(cls, msg: common_pb2.ParallelLayout, *,
                   world_size: int | None = None) -> Layout:
        """The layout `msg` describes. Unset (zero) fields take their defaults: pp and tp 1,
        dp the replicas that `world_size` ranks make (1 without it), schedule "1f1b",
        microbatches and grad_accum 1."""
        pp, tp = msg.pp or 1, msg.tp or 1
        dp = msg.dp or (world_size // (pp * tp) if world_size else 1)
        return cls(dp=dp, pp=pp, tp=tp,
                   stages=tuple((s.first_layer, s.last_layer) for s in msg.stages),
                   schedule=msg.schedule or "1f1b", microbatches=msg.microbatches or 1,
                   grad_accum=msg.grad_accum or 1, microbatch_total=msg.microbatch_total)


def unequal_shares_fit(dp: int, pp: int, microbatches: int, grad_accum: int,
                       total: int) -> bool:
    """Whether `total` micro-batches a step can be dealt to `dp` replicas in unequal
    shares: no pipeline, one micro-batch a round, at least one per replica, and
    `grad_accum` rounds, the largest share."""
    return (pp == 1 and microbatches == 1 and total >= dp >= 1
            and grad_accum == -(-total // dp))
