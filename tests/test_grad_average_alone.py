"""`run()`'s gradient average with one replica (dp=1, or what a shrink left): its sum is
its own gradient, so only the division by the step's micro-batches is done, in place,
with the bits the group's average gives (in fp32, then back to the gradient's dtype)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from stalwart.client.grad_average import GradAverage
from stalwart.client.parallel_dims import Group


def test_one_replica_divides_what_its_backward_reached_as_the_group_average_would() -> None:
    torch.manual_seed(0)
    kept, cleared, unreached = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1), torch.nn.Linear(1, 1)
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    params = [*kept.parameters(), *half.parameters(), *cleared.parameters(),
              *unreached.parameters()]
    avg = GradAverage(params, [], torch.device("cpu"), bucket_bytes=1 << 20, overlap=True)
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    avg.start(Group("dp", (0,), 0, pg))
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
