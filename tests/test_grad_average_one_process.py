"""`run()`'s gradient average in one process. With one replica (dp=1, or what a shrink
left) its sum is its own gradient, so only the division by the step's micro-batches is
done, in place, with the bits the group's average gives (in fp32, then back to the
gradient's dtype; in fp64 for fp64 parameters, which no average rounds). An average of
nothing (an optimizer step whose closure has not run yet) leaves the next step's
buckets waiting for the parameters the last backward reached."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from stalwart.client.grad_average import GradAverage
from stalwart.client.parallel_dims import Group


def _group(members: int) -> Group:
    """A group of `members` over a real gloo group of this one process: with two, every
    sum is this process's own tensor, through the path a real group takes."""
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    return Group("dp", tuple(range(members)), 0, pg)


def test_one_replica_divides_what_its_backward_reached_as_the_group_average_would() -> None:
    torch.manual_seed(0)
    kept, cleared, unreached = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1), torch.nn.Linear(1, 1)
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    params = [*kept.parameters(), *half.parameters(), *cleared.parameters(),
              *unreached.parameters()]
    avg = GradAverage(params, [], torch.device("cpu"), bucket_bytes=1 << 20, overlap=True)
    avg.start(_group(1))
    avg.arm()  # a group of one starts nothing while backward runs
    x = torch.randn(2, 3)
    (kept(x).sum() + half(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum()
     + cleared(x).sum()).backward()
    before = [p.grad.clone() for p in params[:4]]
    cleared.weight.grad = None  # the loop cleared it after its backward
    avg.average(lambda fn, what: fn(), 3)
    for p, g in zip(params[:4], before, strict=True):
        assert torch.equal(p.grad, (g.float() / 3).to(g.dtype))
    assert torch.equal(cleared.weight.grad, torch.zeros(1, 3))
    assert unreached.weight.grad is None and unreached.bias.grad is None
    assert not avg.pending


@pytest.mark.parametrize("members", [1, 2])
@pytest.mark.parametrize("divisor", [1, 3])
def test_fp64_gradients_are_averaged_in_fp64(members: int, divisor: int) -> None:
    # Before, every average went through fp32: an fp64 model's gradients were rounded.
    layer = torch.nn.Linear(5, 5).double()
    params = list(layer.parameters())
    avg = GradAverage(params, [], torch.device("cpu"), bucket_bytes=1 << 20, overlap=False)
    avg.start(_group(members))
    layer(torch.randn(3, 5, dtype=torch.float64)).sum().backward()
    layer.weight.grad += 1e-12  # below fp32's resolution near these values
    before = [p.grad.clone() for p in params]
    avg.average(lambda fn, what: fn(), divisor)
    for p, g in zip(params, before, strict=True):
        assert p.grad.dtype == torch.float64
        assert torch.equal(p.grad, g / divisor)


def test_an_average_of_nothing_leaves_the_next_steps_buckets_overlapped() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512),
                              torch.nn.Linear(512, 1))  # buckets of at least 1 MiB
    params = list(net.parameters())
    avg = GradAverage(params, [], torch.device("cpu"), bucket_bytes=1 << 20, overlap=True)
    avg.start(_group(2))
    assert len(avg.buckets) > 1
    for step in range(3):
        # LBFGS: the step's pre-hook averages before the closure ran any backward.
        avg.average(lambda fn, what: fn(), 2)
        avg.arm()
        net(torch.randn(4, 512)).sum().backward()
        avg.average(lambda fn, what: fn(), 2)
        # Before: the empty average said no parameter was reached, so each bucket
        # started at the first gradient, the rest came late and every sum ran again.
        assert avg.overlapped == len(avg.buckets), step
