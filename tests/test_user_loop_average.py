"""What the user loop divides a step's gradients by, where its backward passes do not
run inside the `ctx.batches` loop. A closure given to `optimizer.step` (LBFGS calls it
several times a step) is replaced by the step's pre-hook with one that averages, after
each call, the gradients its backward left and the loss it returned, over the replicas;
micro-batches read ahead of their backward are averaged over, as if the backward had run
inside the loop. Here two replicas are a stub group whose sum doubles (two replicas
holding the same values), so an average over the replicas is the value itself: the tests
check that every call is averaged, whatever the closure returns, that the closure's own
tensors are left alone, and what the sums are divided by."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stalwart.client.user_data import Data
from stalwart.client.user_loop import Context, _UserLoopProgram
from stalwart.client.user_state import StateRegistry
from stalwart.v1 import common_pb2


class _TwoAlike:
    """The sums of two replicas that hold the same tensors."""

    size = 2

    def __init__(self) -> None:
        self.reduced = 0

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        self.reduced += 1
        tensor.mul_(2)


def _program(grad_accum: int = 1
             ) -> tuple[Any, torch.nn.Linear, torch.optim.Optimizer, Any, Context]:
    model = torch.nn.Linear(3, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    program = _UserLoopProgram(lambda ctx: None,
                               StateRegistry({"model": model, "optimizer": optimizer}),
                               2, torch.device("cpu"))
    group = _TwoAlike()
    gen = SimpleNamespace(run_or_abandon=lambda fn, what: fn(),
                          dims=SimpleNamespace(dp_group=group),
                          plan=SimpleNamespace(layout=common_pb2.ParallelLayout(
                              dp=2, grad_accum=grad_accum)),
                          role=SimpleNamespace(coord=SimpleNamespace(dp=0)))
    program.capturer = SimpleNamespace(before_update=lambda: None)
    program.grads.overlap = False  # the stub group sums one tensor at a time
    program.grads.start(group)  # type: ignore[arg-type]
    return program, model, optimizer, gen, Context(gen, program, 0)  # type: ignore[arg-type]


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("by_keyword", [False, True])
@pytest.mark.parametrize("returns", ["tensor", "float", "none"])
def test_each_call_of_a_steps_closure_averages_its_gradients_and_its_loss(
        by_keyword: bool, returns: str) -> None:
    program, model, optimizer, gen, ctx = _program()
    x = torch.randn(4, 3, dtype=torch.float64)
    kept: list[torch.Tensor] = []

    def closure() -> Any:
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        kept.append(loss)
        if returns == "float":
            return float(loss.detach())
        return loss if returns == "tensor" else None

    args, kwargs = (optimizer,), {"closure": closure}
    if not by_keyword:
        args, kwargs = (optimizer, closure), {}
    new_args, new_kwargs = program._before_update(gen, ctx, args, kwargs)
    wrapped = new_kwargs["closure"] if by_keyword else new_args[1]
    assert wrapped is not closure
    for _ in range(2):  # as LBFGS calls it, more than once
        before = gen.dims.dp_group.reduced
        got = wrapped()
        own = kept[-1].detach().clone()
        grads = [p.grad.clone() for p in model.parameters()]
        # The gradients went through the group; so did the loss, unless there was none.
        assert gen.dims.dp_group.reduced - before == (2 if returns == "none" else 3)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(),
                                                         strict=True))
        if returns == "none":
            assert got is None
        elif returns == "float":
            assert isinstance(got, float) and got == float(own)
        else:
            assert torch.is_tensor(got) and got.dtype == torch.float64 and torch.equal(got, own)
        # The closure's own loss is never written into (an fp64 loss on the parameters'
        # device is one the average could alias).
        assert torch.equal(kept[-1].detach(), own)


def test_a_step_without_a_closure_is_left_as_it_was_called() -> None:
    program, _, optimizer, gen, ctx = _program()
    assert program._before_update(gen, ctx, (optimizer,), {}) is None
    assert program._before_update(gen, ctx, (optimizer,), {"closure": None}) is None


def test_a_closure_over_micro_batches_read_before_the_step_is_averaged_over_them() -> None:
    # Two replicas of two micro-batches each (after a shrink, say), read from ctx.batches
    # before the step; the closure backpropagates each one's mean loss and returns the
    # sum: the job's loss and gradient are the sums over the four micro-batches / 4.
    program, model, optimizer, gen, ctx = _program(grad_accum=2)
    x = list(ctx.batches(Data(_Rows(), global_batch=8)))

    def closure(net: torch.nn.Module = model) -> torch.Tensor:
        net.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        for batch in x:
            loss = net(batch).square().mean()
            loss.backward()
            total += loss.detach()
        return total

    alone = copy.deepcopy(model)  # this replica's own values, outside the job
    own = closure(alone)
    grads = [p.grad.clone() for p in alone.parameters()]
    args, _ = program._before_update(gen, ctx, (optimizer, closure), {})
    for _ in range(2):  # every call of the step alike
        got = args[1]()
        # Both replicas hold this one's values: (2 x own) / 4 micro-batches.
        assert torch.equal(got, own * 2 / 4)
        assert all(torch.equal(p.grad, (g * 2) / 4) for p, g in zip(model.parameters(), grads,
                                                                  strict=True))


def test_micro_batches_read_ahead_of_their_backward_are_averaged_over_at_the_step() -> None:
    # `batches = list(ctx.batches(data))`, then a backward per item: after a shrink gave
    # this replica two micro-batches, the step's gradient is still their mean, not the sum
    # (the ctx.batches loop ended before any backward, so it cannot have averaged them).
    program, model, optimizer, gen, ctx = _program(grad_accum=2)
    data = Data(_Rows(), global_batch=8)
    batches = list(ctx.batches(data))
    assert len(batches) == 2
    for x in batches:
        model(x).square().mean().backward()
    own = [p.grad.clone() for p in model.parameters()]
    assert program._before_update(gen, ctx, (optimizer,), {}) is None
    # Both replicas hold this one's values: (2 x own) / 4 micro-batches.
    assert all(torch.equal(p.grad, (g * 2) / 4) for p, g in zip(model.parameters(), own,
                                                              strict=True))


def test_a_step_that_reads_its_micro_batches_but_runs_no_backward_nor_step_is_a_step() -> None:
    # A forward-only step (BatchNorm statistics warming up), and a read-ahead step that
    # GradScaler skips: each read its micro-batches from ctx.batches.
    program, model, optimizer, gen, ctx = _program(grad_accum=2)
    program.capture = lambda *a, **k: None
    program.reduce_losses = lambda *a: None
    gen.check_plan = lambda: None
    gen.step_done = lambda *a: None
    data = Data(_Rows(), global_batch=8)
    for step in ctx.steps(2):
        batches = list(ctx.batches(data))
        if step == 1:
            for x in batches:
                model(x).square().mean().backward()
    assert ctx._finished == 2
