"""`run()`'s gradient average, on real gloo groups of three processes: the buckets are
summed while the last micro-batch's backward runs, the average is the replicas' mean
whatever their backward passes reached, and it is bitwise the average done one bucket
at a time after backward (so a rerun from a snapshot, which may take either way, ends
with the same bits)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from stalwart.client.grad_average import GradAverage
from stalwart.client.parallel_dims import Group

pytestmark = pytest.mark.multiprocess

WORLD = 3
MICRO = 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                        torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                        torch.nn.Linear(32, 4))
        self.expert = torch.nn.Linear(4, 4)  # reached on replica 0 alone, where asked
        self.unused = torch.nn.Linear(4, 4)  # requires grad, reached by no backward

    def forward(self, x: torch.Tensor, expert: bool) -> torch.Tensor:
        y = self.body(x)
        return self.expert(y) if expert else y


def _loss(net: Net, rank: int, step: int, micro: int, expert: bool, part: int = 0
          ) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + part + 100_000 * rank)
    return net(torch.randn(16, 8, generator=g), expert).square().mean()


def _train(group: Group | None, rank: int, *, overlap: bool, steps: int = 3,
           late: bool = False, experts: bool = False, collective: bool = False,
           unfreeze: bool = False, arm: bool = True) -> dict:
    """`steps` steps of MICRO micro-batches; the averaged gradients of each step (or this
    replica's own with group None) and what the average saw. `unfreeze`: the first layer
    is frozen when the average is made and unfrozen from step 1; without `arm`, the loop
    reads no micro-batches from ctx.batches (nothing tells the average the last one)."""
    net = Net()
    params = list(net.parameters())
    first = list(net.body[0].parameters())
    for p in first if unfreeze else ():
        p.requires_grad_(False)
    avg = GradAverage(params, [], torch.device("cpu"), bucket_bytes=2048, overlap=overlap)
    if group is not None:
        avg.start(group)
    out: dict = {"grads": [], "overlapped": [], "summed": []}
    for step in range(steps):
        for p in params:
            p.grad = None
        for p in first if unfreeze and step == 1 else ():
            p.requires_grad_(True)
        for micro in range(MICRO):
            expert = experts and rank == 0
            if micro == MICRO - 1 and group is not None and arm:
                avg.arm()
            _loss(net, rank, step, micro, expert).backward()
            if late and micro == MICRO - 1:
                _loss(net, rank, step, micro, expert, part=1).backward()
            if collective and micro == MICRO - 1 and group is not None:
                total = torch.tensor([float(rank + 1)])
                avg.before_collective()
                group.run(lambda t=total: dist.all_reduce(t, group=group.pg), "test")
                out["summed"].append(total.item())
        if group is not None:
            avg.average(lambda fn, what: fn(), WORLD * MICRO)
        out["overlapped"].append(avg.overlapped)
        out["grads"].append([None if p.grad is None else p.grad.reshape(-1).tolist()
                             for p in params])
    return out


def _ranks(ctx) -> dict:  # noqa: ANN001 - launch's rank context
    pg = dist.ProcessGroupGloo(dist.PrefixStore("test/avg/", ctx.store), ctx.rank, WORLD,
                               datetime.timedelta(seconds=60))
    group = Group("dp", tuple(range(WORLD)), ctx.rank, pg)
    cases = {"overlap": dict(overlap=True), "slow": dict(overlap=False),
             "late": dict(overlap=True, late=True), "late-slow": dict(overlap=False, late=True),
             "experts": dict(overlap=True, experts=True),
             "collective": dict(overlap=True, collective=True),
             "unfrozen": dict(overlap=True, unfreeze=True),
             "unfrozen-unarmed": dict(overlap=True, unfreeze=True, arm=False)}
    out = {name: _train(group, ctx.rank, **kw) for name, kw in cases.items()}
    out["own"] = {name: _train(None, ctx.rank, **kw)["grads"] for name, kw in cases.items()}
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from stalwart.client.launch import run_local

    return run_local(_ranks, WORLD, timeout=180.0)


def _mean_of_own(ranks: list[dict], case: str, step: int, index: int) -> torch.Tensor | None:
    own = [r["own"][case][step][index] for r in ranks]
    given = [torch.tensor(g, dtype=torch.float64) for g in own if g is not None]
    if not given:
        return None
    return sum(given) / (WORLD * MICRO)


def _check_mean(ranks: list[dict], case: str) -> None:
    for step, grads in enumerate(ranks[0][case]["grads"]):
        for r in ranks[1:]:
            assert r[case]["grads"][step] == grads, "replicas hold different averages"
        for index, got in enumerate(grads):
            want = _mean_of_own(ranks, case, step, index)
            if want is None:
                assert got is None, f"parameter {index} reached by no backward got a gradient"
            else:
                assert torch.allclose(torch.tensor(got, dtype=torch.float64), want,
                                      rtol=1e-5, atol=1e-7), (case, step, index)


def test_buckets_are_summed_while_the_last_backward_runs_and_give_the_mean(ranks):
    _check_mean(ranks, "overlap")
    # A parameter no backward reaches (it requires grad) holds its bucket back only in
    # a generation's first step: later ones start buckets during backward.
    assert all(n > 0 for n in ranks[0]["overlap"]["overlapped"][1:])
    assert ranks[0]["slow"]["overlapped"] == [0, 0, 0]


def test_the_overlapped_average_is_bitwise_the_one_taken_after_backward(ranks):
    for r in ranks:
        assert r["overlap"]["grads"] == r["slow"]["grads"]
        assert r["late"]["grads"] == r["late-slow"]["grads"]


def test_a_second_backward_in_the_last_micro_batch_is_averaged_too(ranks):
    _check_mean(ranks, "late")
    assert ranks[0]["late"]["overlapped"] == [0, 0, 0]  # every step went the slow way


def test_a_parameter_only_some_replicas_reach_is_summed_over_all(ranks):
    _check_mean(ranks, "experts")
    expert = [i for i, g in enumerate(ranks[0]["experts"]["grads"][0]) if g is not None
              and ranks[1]["own"]["experts"][0][i] is None]
    assert expert, "the expert's parameters should be reached on replica 0 alone"


def test_the_loops_own_collective_after_backward_starts_behind_the_buckets(ranks):
    _check_mean(ranks, "collective")
    for r in ranks:
        assert r["collective"]["summed"] == [6.0, 6.0, 6.0]


@pytest.mark.parametrize("case", ["unfrozen", "unfrozen-unarmed"])
def test_a_parameter_unfrozen_after_the_start_is_averaged_from_then_on(ranks, case):
    # Frozen when the average was made, so in no bucket: from the step that unfroze it,
    # with or without ctx.batches telling the average the last micro-batch.
    _check_mean(ranks, case)
    assert ranks[0][case]["grads"][0][0] is None  # frozen in step 0
    assert ranks[0][case]["grads"][1][0] is not None
