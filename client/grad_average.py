"""The user loop's gradient average over its data-parallel replicas.

`run()` averages the gradients that the loop's backward passes accumulated, over the
replicas and the step's micro-batches, where DDP would have: when the last micro-batch
of `ctx.batches` is through. Like DDP, it starts the sums while that micro-batch's
backward is still running: the dense parameters are cut, once, into buckets in reverse
registration order (roughly the order in which backward finishes them), and a bucket's
all-reduce starts from the gradient hook of its last parameter, each bucket after the
one before it, so every replica starts the same collectives in the same order.

What DDP assumes and a user's loop may not do is caught:
- a parameter that no replica's backward reached in the last step (a frozen module
  that still requires grad, an expert that got no tokens) does not hold its bucket
  back; a replica whose backward reaches fewer parameters starts the buckets of the
  ones it missed when its backward is over, in order, with the gradient it holds;
- a backward that adds to a gradient whose bucket already started (two backward passes
  in the last micro-batch, an expert that got tokens again) marks the step late: every
  replica learns it from the small all-reduce that ends the step (which also says which
  parameters any replica's backward reached) and sums again, one bucket at a time, from
  its own gradients, which the overlapped sums never touched;
- the loop's own collective (`ctx.collective`) after that backward starts behind every
  bucket.

A bucket's sum is written into `.grad` only after that last all-reduce, and only for
parameters that some replica's backward reached (the others keep `grad` None). Every
sum, overlapped or not, is over the same fixed buckets, so a step's average is bitwise
the same whichever way it went, in a run and in its rerun from a snapshot. A parameter
in no bucket (frozen when `run()` started and unfrozen since, or sparse) is summed
after them, in groups fixed by which parameters the replicas reached.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from stalwart.client.parallel_dims import Group

__all__ = ["GradAverage", "consecutive_buckets"]

OVERLAP_BUCKET_BYTES = (1 << 20, 16 << 20)
"""The smallest and largest bucket (fp32 bytes) summed while backward runs: an eighth of
the gradients between them, so that the first bucket starts early in backward and the
last one, which no backward hides, is short."""


@dataclass
class _Started:
    flat: torch.Tensor
    work: Any
    started: float


@dataclass
class _Armed:
    """The last micro-batch of a step, whose backward starts the buckets."""

    pending: list[int]
    """Parameters of each bucket that the step waits for and whose gradient hook has
    not fired yet."""
    awaited: list[bool]
    """The parameters the step waits for: those some replica reached in the last step
    (every one in a generation's first)."""
    fired: list[bool]
    started: list[_Started] = field(default_factory=list)
    late: bool = False
    error: BaseException | None = None


class GradAverage:
    """Averages the gradients of `params` over a generation's data-parallel group.

    The buckets summed while backward runs hold the dense parameters that require grad
    when this is made; any other parameter with a gradient (one a loop unfroze since,
    or a sparse one) is summed after them. `sparse` are the parameters whose gradients
    are sparse (nn.Embedding(sparse=True)): they are summed densely with a mark per row.
    `bucket_bytes` bounds the all-reduces of the slow path (the memory it needs beside
    the gradients); the overlapped path holds every bucket until the step's end, one
    fp32 copy of the gradients. `overlap=False` averages every step the slow way.
    """

    def __init__(self, params: list[torch.nn.Parameter], sparse: list[torch.nn.Parameter],
                 device: torch.device, *, bucket_bytes: int, overlap: bool) -> None:
        self.params, self.sparse, self.device = params, sparse, device
        self.bucket_bytes, self.overlap = bucket_bytes, overlap
        self.fresh = [False] * len(params)
        """Which parameters' gradients a backward accumulated since the last average."""
        sparse_ids = {id(p) for p in sparse}
        order = [i for i in reversed(range(len(params)))
                 if id(params[i]) not in sparse_ids and params[i].requires_grad]
        sizes = [params[i].numel() * 4 for i in order]
        least, most = OVERLAP_BUCKET_BYTES
        limit = min(bucket_bytes, max(least, min(most, sum(sizes) // 8)))
        self.buckets = [[order[b] for b in bucket]
                        for bucket in consecutive_buckets(sizes, limit)]
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.group: Group | None = None
        self._armed: _Armed | None = None
        self._reached: set[int] | None = None
        self.overlapped = 0
        """Buckets of the last average that started while its backward ran."""
        self._marked: list[torch.nn.Parameter] = []  # the sparse ones the last tail marked
        self._unhooked = list(range(len(params)))
        self._hook_new()

    def _hook_new(self) -> None:
        """Hook every parameter that requires grad and has no hook yet: all at the start,
        later one that a loop unfroze. A gradient it holds by then accumulated before
        its hook could say so."""
        if not self._unhooked:
            return
        frozen = []
        for i in self._unhooked:
            p = self.params[i]
            if not p.requires_grad:
                frozen.append(i)
                continue
            self.fresh[i] = p.grad is not None
            p.register_post_accumulate_grad_hook(lambda _, i=i: self._accumulated(i))
        self._unhooked = frozen

    @property
    def pending(self) -> bool:
        """Whether a backward accumulated gradients since the last average."""
        return any(self.fresh)

    def start(self, group: Group) -> None:
        """A new generation over `group`: nothing accumulated, nothing in flight (the
        last generation's started sums are left to its broken groups)."""
        self.group, self._armed, self._reached = group, None, None
        self.fresh = [False] * len(self.params)

    def arm(self) -> None:
        """The next backward is the last micro-batch's: its hooks start the buckets."""
        self.overlapped = 0
        self._hook_new()
        if self.overlap and self.group is not None and self.group.size > 1 and self.buckets:
            awaited = [self._reached is None or i in self._reached
                       for i in range(len(self.params))]
            self._armed = _Armed(pending=[sum(awaited[i] for i in b) for b in self.buckets],
                                 awaited=awaited, fired=[False] * len(self.params))

    def before_collective(self) -> None:
        """The loop's own collective is about to start: after a backward of the last
        micro-batch, every bucket starts first, so the replicas start the same sequence
        whichever parameters their backward reached."""
        armed = self._armed
        if armed is not None and any(armed.fired):
            self._start_buckets(armed, every=True)

    def _accumulated(self, index: int) -> None:
        self.fresh[index] = True
        armed = self._armed
        if armed is None:
            return
        if armed.fired[index]:
            armed.late = True  # a second backward in the last micro-batch
            return
        armed.fired[index] = True
        bucket = self.bucket_of.get(index)
        if bucket is None:
            return
        if bucket < len(armed.started):
            armed.late = True  # its bucket started without it
            return
        if armed.awaited[index]:
            armed.pending[bucket] -= 1
        self._start_buckets(armed, every=False)

    def _start_buckets(self, armed: _Armed, every: bool) -> None:
        """Start the buckets in order, up to the first one still waiting for a gradient
        (every one, with `every`)."""
        while len(armed.started) < len(self.buckets) and (
                every or armed.pending[len(armed.started)] == 0):
            members = self.buckets[len(armed.started)]
            armed.started.append(self._start(armed, self._flat(members)))
            if not every:
                self.overlapped += 1

    def _start(self, armed: _Armed, flat: torch.Tensor) -> _Started:
        started = time.monotonic()
        work = None
        if armed.error is None:
            assert self.group is not None
            group = self.group
            try:  # from a gradient hook: raised at the step's end, not inside backward
                work = group.run(lambda: dist.all_reduce(flat, group=group.pg, async_op=True),
                                 "all_reduce", started)
            except Exception as exc:  # noqa: BLE001 - kept for the waiting thread
                armed.error = exc
        return _Started(flat, work, started)

    def average(self, run: Callable[[Callable[[], Any], str], Any], divisor: int) -> None:
        """Average what was accumulated since the last average: the sums over the group
        divided by `divisor`. `run(fn, what)` runs a wait (Generation.run_or_abandon)."""
        self._hook_new()
        armed, self._armed = self._armed, None
        if armed is None:
            self._average_slowly(run, divisor)
            return
        self._start_buckets(armed, every=True)
        tail = self._tail(armed.late)
        last = self._start(armed, tail)
        if armed.error is not None:
            raise armed.error
        started = [*armed.started, last]
        assert self.group is not None
        group = self.group

        def wait() -> None:
            for s in started:
                group.wait(s.work, "all_reduce", s.started)
                group.count_allreduce(s.flat.numel() * s.flat.element_size())
        run(wait, "grad-reduce")
        given, late, touched = self._read_tail(tail)
        if late:
            self.overlapped = 0
            self._average_slowly(run, divisor)
            return
        self.fresh = [False] * len(self.params)
        reached = self._note_reached(given)
        for members, s in zip(self.buckets, armed.started, strict=True):
            if reached.intersection(members):
                self._write_bucket(members, s.flat.div_(divisor), reached, touched)
        self._reduce(run, [i for i in given if i not in self.bucket_of], divisor, touched)

    def _average_slowly(self, run: Callable[[Callable[[], Any], str], Any],
                        divisor: int) -> None:
        assert self.group is not None
        group = self.group
        if group.size == 1 and not self.sparse and self._average_alone(divisor):
            return
        tail = self._tail(False)
        run(lambda: group.all_reduce(tail), "grad-reduce")
        given, _, touched = self._read_tail(tail)
        self.fresh = [False] * len(self.params)
        reached = self._note_reached(given)
        # The buckets the overlapped sums use, one at a time, where a parameter of theirs
        # was reached: the same sums, so the same bits.
        for members in self.buckets:
            if reached.intersection(members):
                flat = self._flat(members)
                run(lambda flat=flat: group.all_reduce(flat), "grad-reduce")
                self._write_bucket(members, flat.div_(divisor), reached, touched)
        self._reduce(run, [i for i in given if i not in self.bucket_of], divisor, touched)

    def _note_reached(self, given: list[int]) -> set[int]:
        """Remember what the replicas' backward reached, for the next step's buckets to
        wait for; an average of nothing (a step's closure not yet run) leaves it."""
        reached = set(given)
        if reached:
            self._reached = reached
        return reached

    def _average_alone(self, divisor: int) -> bool:
        """A group of one replica: its sum is this replica's own gradient, so only the
        division is left, done as the group's average does it (in the bucket's precision,
        then back to the gradient's dtype): the same bits, without a copy of every
        gradient. False, with nothing done, where a gradient is sparse (the average
        makes it dense)."""
        reached = [i for i, fresh in enumerate(self.fresh) if fresh]
        grads = [self.params[i].grad for i in reached]
        if any(g is not None and g.is_sparse for g in grads):
            return False
        self.fresh = [False] * len(self.params)
        self._note_reached(reached)
        for i, g in zip(reached, grads, strict=True):
            p = self.params[i]
            if g is None:  # cleared after its backward: it adds zeros, as a replica's
                p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            elif divisor != 1 and g.dtype in (torch.float32, torch.float64):
                g.div_(divisor)
            elif divisor != 1:
                g.copy_(g.float().div_(divisor))
        return True

    def _write_bucket(self, members: list[int], flat: torch.Tensor, reached: set[int],
                      touched: dict[int, torch.Tensor]) -> None:
        grads, pieces = [], []
        for i, piece in zip(members, flat.split([self.params[i].numel() for i in members]),
                            strict=True):
            if i not in reached:
                continue
            grad = self.params[i].grad
            if grad is not None and not grad.is_sparse and id(self.params[i]) not in touched:
                grads.append(grad)  # the common case, copied all at once below
                pieces.append(piece.view(grad.shape))
            else:
                self._write(i, piece, touched)
        for dtype in {g.dtype for g in grads}:  # one dtype per call: CUDA kernels assume it
            same = [k for k, g in enumerate(grads) if g.dtype == dtype]
            torch._foreach_copy_([grads[k] for k in same], [pieces[k] for k in same])

    def _tail(self, late: bool) -> torch.Tensor:
        """One number per parameter counts the replicas whose backward reached it since
        the last average: one that none reached is left as it is (a parameter no
        backward reached keeps grad None, so the optimizer skips it, as it would have in
        one process). One that some reached is averaged over all, each replica giving
        the gradient it holds: a part averaged before is the same on every replica.
        Then whether a replica's step was late, then a sparse embedding's marks: its
        gradient is summed densely, with a mark per row that any replica touched, and
        given back sparse over those rows; dense where a replica had a dense one (a
        weight tied to a dense layer)."""
        device = self.params[0].device if self.params else self.device
        had = torch.tensor([float(f) for f in self.fresh] + [float(late)], device=device)
        # Only those that require grad (the same on every replica): a frozen embedding's
        # rows cost nothing.
        self._marked = [p for p in self.sparse if p.requires_grad]
        marks = [torch.zeros(p.shape[0] + 1, device=device) for p in self._marked]
        for p, mark in zip(self._marked, marks, strict=True):
            if p.grad is not None and p.grad.is_sparse:
                mark[p.grad.coalesce().indices()[0]] = 1.0
            elif p.grad is not None:
                mark[-1] = 1.0
        return torch.cat([had, *marks])

    def _read_tail(self, tail: torch.Tensor) -> tuple[list[int], bool, dict[int, torch.Tensor]]:
        """The parameters some replica reached, whether a replica was late, and the rows
        touched of each sparse gradient that stays sparse."""
        n = len(self.params)
        counts = tail[:n + 1].tolist()
        given = [i for i, c in enumerate(counts[:n]) if c > 0]
        touched = {id(p): mark[:-1] for p, mark in zip(self._marked, tail[n + 1:].split(
            [p.shape[0] + 1 for p in self._marked]), strict=True) if mark[-1] == 0}
        return given, counts[n] > 0, touched

    def _reduce(self, run: Callable[[Callable[[], Any], str], Any], given: list[int],
                divisor: int, touched: dict[int, torch.Tensor]) -> None:
        """Sum the gradients of `given` (the sparse ones) one bucket of at most
        bucket_bytes (as fp32) at a time: the average needs that much memory beside them,
        not a copy of all."""
        assert self.group is not None
        group = self.group
        sizes = [self.params[i].numel() for i in given]
        for bucket in consecutive_buckets(sizes, self.bucket_bytes // 4):
            members = [given[b] for b in bucket]
            flat = self._flat(members)
            run(lambda flat=flat: group.all_reduce(flat), "grad-reduce")
            self._write_bucket(members, flat.div_(divisor), set(members), touched)

    def _flat(self, members: list[int]) -> torch.Tensor:
        """The gradients of `members` as one tensor, what this replica adds: fp32, or
        fp64 where a member is fp64 (its gradient is not rounded)."""
        wide = any(self.params[i].dtype == torch.float64 for i in members)
        dtype = torch.float64 if wide else torch.float32
        return torch.cat([_dense_grad(self.params[i]).reshape(-1).to(dtype) for i in members])

    def _write(self, index: int, piece: torch.Tensor, touched: dict[int, torch.Tensor]) -> None:
        p = self.params[index]
        dtype = p.dtype if p.grad is None else p.grad.dtype
        piece = piece.view(p.shape).to(dtype)
        if id(p) in touched:
            rows = touched[id(p)].nonzero().reshape(1, -1)
            p.grad = torch.sparse_coo_tensor(rows, piece[rows[0]], p.shape).coalesce()
        elif p.grad is None or p.grad.is_sparse:
            p.grad = piece.clone()
        else:
            p.grad.copy_(piece)


def _dense_grad(p: torch.Tensor) -> torch.Tensor:
    """What a replica adds to a parameter's average: its gradient, dense (zeros if none)."""
    if p.grad is None:
        return torch.zeros_like(p)
    return p.grad.to_dense() if p.grad.is_sparse else p.grad


def consecutive_buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices of `sizes`, grouped so that each group's sum stays within
    `limit` (a single size above it is a group of its own)."""
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if out and total + n <= limit:
            out[-1].append(i)
            total += n
        else:
            out.append([i])
            total = n
    return out
