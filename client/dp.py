"""Data parallelism: sum gradients over the data-parallel group in buckets that start
while backward is still running. Accumulation over micro-batches is plain autograd
accumulation; only the last backward of a step is "armed" and triggers communication.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["COMPRESSION", "GradReducer", "ReduceFn"]

COMPRESSION = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}

ReduceFn = Callable[[torch.Tensor, Any], None]


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.pending = len(params)
        self.future: Future | None = None
        self.buffer: torch.Tensor | None = None


class GradReducer:
    """Bucketed, overlapped gradient sum over a data-parallel group.

    Buckets are summed by `group.all_reduce` (a parallel_dims Group: counted by link and
    guarded by its watchdog), or by `reduce_fn(tensor, group.pg)`, which must leave the
    elementwise SUM over the group in `tensor` and counts its own bytes (callers scale
    losses so that the sum is the global mean). Either runs on one communication thread,
    in bucket order, so every rank issues the same sequence.
    """

    def __init__(self, params: list[torch.nn.Parameter], group: Any, *,
                 bucket_bytes: int = 1 << 20, compress: str = "none",
                 reduce_fn: ReduceFn | None = None) -> None:
        if compress not in COMPRESSION:
            raise ValueError(f"compress={compress!r}; choose one of {list(COMPRESSION)}")
        self.group = group
        self.wire_dtype = COMPRESSION[compress]
        self.reduce_fn = reduce_fn
        self.active = group.size > 1
        self.armed = False
        self.overlapped = 0
        """Buckets of the last step whose reduction started while gradients of other
        buckets were still being computed."""
        self.buckets: list[_Bucket] = []
        self._next = 0
        self._hooks: list[Any] = []
        self._pool: ThreadPoolExecutor | None = None
        if not self.active:
            return
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-reduce")
        # Reverse registration order approximates the order in which backward finishes.
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current))
        for b_index, bucket in enumerate(self.buckets):
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda _p, b=b_index: self._grad_ready(b)))

    def arm(self) -> None:
        """Call before the last backward of a step: its gradients are final and get summed."""
        self.armed = self.active
        for bucket in self.buckets:
            bucket.pending, bucket.future, bucket.buffer = len(bucket.params), None, None
        self._next = 0
        self.overlapped = 0

    def _grad_ready(self, b_index: int) -> None:
        if not self.armed:
            return
        self.buckets[b_index].pending -= 1
        # Launch strictly in bucket order so all ranks issue identical collective sequences.
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1
            self.overlapped += any(b.pending for b in self.buckets)

    def _launch(self, bucket: _Bucket) -> None:
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])
        if self.wire_dtype is not None:
            flat = flat.to(self.wire_dtype)
        # The comm thread's collective must start after the bucket is filled on this
        # (the backward's) stream: an event it waits on, not a host synchronisation,
        # which would drain the GPU's queue of backward work at every bucket.
        ready = _recorded(flat)
        bucket.buffer = flat
        if self.reduce_fn is None:
            bucket.future = self._pool.submit(_after(ready, self.group.all_reduce), flat)
        else:
            bucket.future = self._pool.submit(_after(ready, self.reduce_fn), flat,
                                              self.group.pg)

    def finish(self) -> None:
        """Wait for every bucket and write the summed gradients back (fp32)."""
        if not self.armed:
            return
        while self._next < len(self.buckets):  # parameters that got no gradient this step
            self._launch(self.buckets[self._next])
            self._next += 1
        for bucket in self.buckets:
            bucket.future.result()
            offset = 0
            for p in bucket.params:
                n = p.numel()
                p.grad.copy_(bucket.buffer[offset:offset + n].view_as(p.grad))
                offset += n
            bucket.buffer = bucket.future = None
        self.armed = False

    def close(self, wait: bool = True) -> None:
        """Remove the hooks and stop the communication thread. After a failure pass
        wait=False: a reduction stuck on a dead peer (gloo ignores abort) then ends on its
        own at the process-group timeout instead of blocking the rebuild."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None


def _recorded(tensor: torch.Tensor) -> Any:
    """An event recorded on the current stream after `tensor`'s pending work (None on
    the CPU, where that work is done)."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def _after(event: Any, fn: Callable[..., None]) -> Callable[..., None]:
    """`fn`, run once the calling thread's stream has waited for `event`."""
    def run(*args: Any) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        fn(*args)
    return run
