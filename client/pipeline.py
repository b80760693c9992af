"""Pipeline parallelism: GPipe and 1F1B schedules as plain lists of actions, and one
executor that runs a stage's list with point-to-point sends and receives. Sends never
block (they are waited for at the end of the round), receives block, so any schedule
whose receives come in dependency order cannot deadlock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SCHEDULES", "PipelineStats", "StepInterrupted", "run_schedule", "schedule"]

SCHEDULES = ("gpipe", "1f1b")


def schedule(kind: str, stages: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """The ordered actions of `stage`: ("F", i) forward or ("B", i) backward of micro-batch i.

    GPipe runs every forward, then every backward: m micro-batches of activations live at once.
    1F1B runs (stages - stage - 1) warm-up forwards, then alternates one forward with one
    backward, then drains: at most (stages - stage) micro-batches live at once.
    """
    m = microbatches
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"schedule {kind!r} is unknown; choose one of {SCHEDULES}")
    warmup = min(stages - stage - 1, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    actions += [("B", i) for i in range(m - warmup, m)]
    return actions


@dataclass
class PipelineStats:
    """What one stage measured while running its schedule."""

    busy_s: float = 0.0
    """Seconds spent computing forward and backward (not waiting on neighbours)."""
    wall_s: float = 0.0
    """Seconds from the first action to the last send completed."""
    peak_activation_bytes: int = 0
    """Most bytes of tensors saved for backward (parameters excluded) alive at once."""
    _live: int = 0
    _per_mb: dict[int, int] = field(default_factory=dict)


class StepInterrupted(Exception):
    """A step left between two of its actions because `interrupted()` became true (a
    newer plan: the generation's step is abandoned, and its compute is not wanted)."""


def _tag(microbatch: int, backward: bool) -> int:
    return 2 * microbatch + int(backward)


def run_schedule(stage: torch.nn.Module, actions: list[tuple[str, int]], pp: Any, *,
                 inputs: list[torch.Tensor] | None, loss_fn: Callable[[torch.Tensor, int], Any],
                 in_shape: tuple[int, ...] = (), out_shape: tuple[int, ...] = (),
                 in_dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 autocast: Callable[[], AbstractContextManager] = nullcontext,
                 before_last_backward: Callable[[], None] | None = None,
                 stats: PipelineStats | None = None,
                 interrupted: Callable[[], bool] | None = None) -> list[float]:
    """Run one round of micro-batches through this stage; returns the last stage's losses.
    Before each forward or backward, `interrupted()` true raises StepInterrupted.

    `pp` is the pipeline Group (index = stage number). The first stage reads micro-batch i
    from `inputs[i]`; the last calls `loss_fn(output, i)` which returns (tensor to
    backpropagate, loss value to report). A stage after the first receives activations
    of `in_shape` (sent as fp32, computed on as `in_dtype`) and sends their gradients
    back; one before the last sends its output, of `out_shape`, and receives its gradient.
    """
    first, last = pp.index == 0, pp.index == pp.size - 1
    fwd_in: dict[int, torch.Tensor] = {}
    fwd_out: dict[int, torch.Tensor] = {}
    losses: dict[int, float] = {}
    sends: list[Any] = []
    last_b = [i for kind, i in actions if kind == "B"][-1]
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    started = time.perf_counter()
    for kind, i in actions:
        if interrupted is not None and interrupted():
            raise StepInterrupted(f"left before {kind}{i}")
        if kind == "F":
            if first:
                x = inputs[i]
            else:
                # Receive micro-batch i's activation from the previous stage.
                x = torch.empty(in_shape, dtype=torch.float32, device=device)
                pp.recv(x, pp.index - 1, _tag(i, False))
                x = x.to(in_dtype).requires_grad_()
            t0 = time.perf_counter()
            with _saved_tensor_accounting(stats, i, params), autocast():
                y = stage(x)
                if last:
                    y, losses[i] = loss_fn(y, i)
            if stats is not None:
                stats.busy_s += time.perf_counter() - t0
            if not last:
                # Send micro-batch i's activation to the next stage; wait at round end.
                sends.append(pp.isend(y.detach().float(), pp.index + 1, _tag(i, False)))
            fwd_in[i], fwd_out[i] = x, y
        else:
            x, y = fwd_in.pop(i), fwd_out.pop(i)
            if last:
                grad = None
            else:
                # Receive d(loss)/d(our output) for micro-batch i from the next stage.
                grad = torch.empty(out_shape, dtype=torch.float32, device=device)
                pp.recv(grad, pp.index + 1, _tag(i, True))
                grad = grad.to(y.dtype)
            if i == last_b and before_last_backward is not None:
                before_last_backward()
            t0 = time.perf_counter()
            if y.requires_grad:  # else nothing before it trains (frozen blocks on the data)
                torch.autograd.backward(y, grad)
            if stats is not None:
                stats.busy_s += time.perf_counter() - t0
                stats._live -= stats._per_mb.pop(i, 0)
            if not first:
                # Send d(loss)/d(our input) for micro-batch i back to the previous stage.
                dx = x.grad if x.grad is not None else torch.zeros_like(x)
                sends.append(pp.isend(dx.float(), pp.index - 1, _tag(i, True)))
    for work in sends:
        work.wait()
    if stats is not None:
        stats.wall_s += time.perf_counter() - started
    return [losses[i] for i in sorted(losses)]


def _saved_tensor_accounting(stats: PipelineStats | None, mb: int,
                             params: set[int]) -> AbstractContextManager:
    """Count bytes of distinct non-parameter tensors autograd saves for micro-batch `mb`."""
    if stats is None:
        return nullcontext()
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            nbytes = t.untyped_storage().nbytes()
            stats._per_mb[mb] = stats._per_mb.get(mb, 0) + nbytes
            stats._live += nbytes
            stats.peak_activation_bytes = max(stats.peak_activation_bytes, stats._live)
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
