"""A map-style dataset dealt to data-parallel ranks from one job-wide sample cursor.

Step s reads global sample positions s*G .. s*G+G-1 (G = global batch), each position
mapped through the seeded permutation of its epoch. The positions of a step are the
same whatever the layout; the layout only decides which rank reads which of them, so
shrinking or growing data parallelism skips and repeats nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import default_collate

if TYPE_CHECKING:
    from stalwart.core.layout import Layout

__all__ = ["Data"]


class Data:
    """`dataset` (anything with `__len__` and `__getitem__`) read `global_batch` samples
    per optimizer step, shuffled per epoch from `seed` (or in order, `shuffle=False`)."""

    def __init__(self, dataset: Any, *, global_batch: int, seed: int = 0, shuffle: bool = True,
                 collate: Callable[[list[Any]], Any] = default_collate) -> None:
        try:
            size = len(dataset)
        except TypeError:
            raise TypeError(f"{type(dataset).__name__} has no len(); stalwart.Data deals a "
                            "map-style dataset. For an iterable one, register its stateful "
                            "loader as state and read it yourself") from None
        if size <= 0:
            raise ValueError("the dataset is empty")
        if global_batch <= 0:
            raise ValueError(f"global_batch={global_batch}; give the samples per optimizer "
                             "step across the whole job (a positive number)")
        self.dataset, self.global_batch, self.seed = dataset, global_batch, seed
        self.shuffle, self.collate, self.size = shuffle, collate, size
        self._perm: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = (epoch, torch.randperm(self.size, generator=gen))
            else:
                self._perm = (epoch, torch.arange(self.size))
        return self._perm[1]

    def indices(self, step: int) -> list[int]:
        """Dataset indices of the whole job's batch of step `step` (0-based)."""
        out = []
        for pos in range(step * self.global_batch, (step + 1) * self.global_batch):
            epoch, at = divmod(pos, self.size)
            out.append(int(self._order(epoch)[at]))
        return out

    def shares(self, step: int, layout: Layout, dp_rank: int) -> list[list[int]]:
        """The micro-batches (dataset indices) data-parallel rank `dp_rank` of `layout`
        reads in step `step`: its consecutive share of the step's batch cut into the
        layout's micro-batches (unequal shares included)."""
        total = layout.total_microbatches
        micro, rest = divmod(self.global_batch, total)
        if rest:
            raise ValueError(f"global batch {self.global_batch} does not split into dp="
                             f"{layout.dp} x {total // layout.dp} micro-batch(es); choose a "
                             f"global batch that divides by {total}")
        first, count = layout.replica_microbatches(dp_rank)
        batch = self.indices(step)
        return [batch[i * micro:(i + 1) * micro] for i in range(first, first + count)]

    def batch(self, indices: Sequence[int]) -> Any:
        return self.collate([self.dataset[i] for i in indices])

    def state_dict(self) -> dict[str, Any]:
        # The cursor is the step itself; this only guards against a changed job.
        return {"global_batch": self.global_batch, "seed": self.seed, "size": self.size,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        if state != mine:
            changed = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
            raise ValueError(f"the committed step was taken with other data settings "
                             f"{changed} (committed, now); resume with the same dataset, "
                             "global batch, seed and shuffle")
