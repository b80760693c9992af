"""What a loop sees between its micro-batches and `optimizer.step()`: the job's averaged
gradients, as under DDP. Clipping by the global norm clips the job's gradient (not each
replica's), a GradScaler that finds a non-finite gradient on one replica skips the step
on every replica (a skipped step is a step), a parameter no replica's backward reached
keeps no gradient, so the optimizer leaves it alone, a sparse embedding's gradient
stays sparse, over the rows any replica touched, a second backward after the
micro-batches (a GAN's generator step) is averaged before the optimizer step that
follows it, and an optimizer that calls a closure (LBFGS) gets the job's gradients and
loss from every call. On real daemons and rank processes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from example_runs import run_example
from programs import closure_steps, scaled_steps, sparse_rows, two_phases

pytestmark = pytest.mark.multiprocess

SCRIPT = "tests/programs/scaled_steps.py"
STEPS = 14


def trained(tmp_path: Path, name: str, script: str = SCRIPT, steps: int = STEPS, **kw
            ) -> tuple[list[dict], object]:
    folder = tmp_path / name
    folder.mkdir()
    os.environ["PARAMS_DIR"] = str(folder)
    try:
        run = run_example(tmp_path / f"{name}-cluster", script, "--steps", str(steps), **kw)
    finally:
        del os.environ["PARAMS_DIR"]
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))], run


def one_process() -> tuple[dict[str, torch.Tensor], float, list[int]]:
    """The same training in one process on the whole global batch, without Stalwart."""
    model, optimizer, scaler = scaled_steps.build()
    samples, skipped = scaled_steps.Samples(), []
    batch = scaled_steps.GLOBAL_BATCH
    for step in range(STEPS):
        x, y = (torch.stack(t) for t in zip(*(samples[i] for i in
                                             range(step * batch, (step + 1) * batch)),
                                            strict=True))
        scaler.scale(F.mse_loss(model(x), y)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaled_steps.update(model, optimizer, scaler)
        if all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)):
            skipped.append(step)
    return model.state_dict(), scaler.get_scale(), skipped


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, torch.Tensor], float]:
    params, scale, skipped = one_process()
    # The data makes GradScaler skip exactly the steps holding an infinite sample.
    assert skipped == [4, 9]
    return params, scale


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    outs, run = trained(tmp_path_factory.mktemp("base"), "base")
    assert len(outs) == 2, run.logs[-4000:]
    return outs


def test_every_replica_sees_the_jobs_gradients_before_its_optimizer_step(
        uninterrupted, reference) -> None:
    params, scale = reference
    untouched = scaled_steps.build()[0].state_dict()
    assert all(torch.equal(params[k], untouched[k]) for k in ("unused.weight", "unused.bias"))
    for out in uninterrupted:
        # Clipped by the norm of the averaged gradient, skipped where any replica's
        # gradient was not finite: one process on the whole batch, up to summation order.
        assert out["scale"] == scale
        for name, value in params.items():
            got = torch.tensor(out["params"][name])
            assert torch.allclose(got, value, rtol=1e-5, atol=1e-6), name
    assert uninterrupted[0]["params"] == uninterrupted[1]["params"]


def test_a_rank_killed_after_a_skipped_step_is_replaced_bitwise(tmp_path: Path,
                                                                uninterrupted) -> None:
    outs, run = trained(tmp_path, "killed", spares=1, kill_rank=1, kill_after_step=6)
    assert len(outs) == 2, run.logs[-4000:]
    assert run.plans[-1].layout.dp == 2 and len(run.plans) >= 2
    # GradScaler's scale and growth tracker are restored with the model.
    assert [o["scale"] for o in outs] == [o["scale"] for o in uninterrupted]
    assert [o["params"] for o in outs] == [o["params"] for o in uninterrupted]
    assert not math.isnan(run.losses[STEPS])


@pytest.mark.parametrize("bucket_mb", ["64", "0.0001"])  # one all-reduce; two
def test_a_sparse_embedding_gradient_is_averaged_over_the_rows_any_replica_touched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bucket_mb: str) -> None:
    monkeypatch.setenv("STALWART_GRAD_BUCKET_MB", bucket_mb)
    outs, run = trained(tmp_path, "sparse", "tests/programs/sparse_rows.py")
    assert len(outs) == 2, run.logs[-4000:]
    model, sparse, dense = sparse_rows.build()
    samples, batch = sparse_rows.Tokens(), sparse_rows.GLOBAL_BATCH
    for step in range(STEPS):  # one process, the whole global batch
        tokens, targets = (torch.stack(t) for t in zip(
            *(samples[i] for i in range(step * batch, (step + 1) * batch)), strict=True))
        sparse_rows.loss_of(model, tokens, targets).backward()
        sparse.step()
        dense.step()
        sparse.zero_grad()
        dense.zero_grad()
    for name, value in model.state_dict().items():
        for out in outs:
            assert torch.allclose(torch.tensor(out[name]), value, rtol=1e-5, atol=1e-6), name


def test_a_backward_after_the_micro_batches_is_averaged_before_its_optimizer_step(
        tmp_path: Path) -> None:
    outs, run = trained(tmp_path, "phases", "tests/programs/two_phases.py")
    assert len(outs) == 2, run.logs[-4000:]
    gen, disc, gen_opt, disc_opt = two_phases.build()
    samples, batch = two_phases.Real(), two_phases.GLOBAL_BATCH
    for step in range(STEPS):  # one process; the generator's samples are each replica's last
        real = torch.stack([samples[i] for i in range(step * batch, (step + 1) * batch)])
        two_phases.disc_loss(gen, disc, real).backward()
        disc_opt.step()
        disc_opt.zero_grad()
        halves = real.split(batch // 2)
        sum(two_phases.gen_loss(gen, disc, half) for half in halves).div(2).backward()
        gen_opt.step()
        gen_opt.zero_grad()
        disc_opt.zero_grad()
    assert outs[0] == outs[1]  # before: each replica stepped its generator on its own
    for key, module in (("gen", gen), ("disc", disc)):
        for name, value in module.state_dict().items():
            got = torch.tensor(outs[0][f"{key}.{name}"])
            assert torch.allclose(got, value, rtol=1e-5, atol=1e-6), f"{key}.{name}"


# LBFGS's line search magnifies rounding: after 14 steps one process in fp32 and fp64
# differ by 1e-3, after 6 by 2e-6.
CLOSURE_STEPS = 6


@pytest.fixture(scope="module")
def closure_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    outs, run = trained(tmp_path_factory.mktemp("closure"), "closure",
                        "tests/programs/closure_steps.py", CLOSURE_STEPS)
    assert len(outs) == 2, run.logs[-4000:]
    return outs


def test_an_optimizer_calling_a_closure_sees_the_jobs_gradients_and_loss_in_each_call(
        closure_run) -> None:
    # Before: each replica's line search ran on its own loss and gradients, and the
    # replicas ended with different models.
    assert closure_run[0] == closure_run[1]
    model, optimizer = closure_steps.build()
    samples, batch = closure_steps.Samples(), closure_steps.GLOBAL_BATCH
    for step in range(CLOSURE_STEPS):  # one process on the whole global batch
        x, y = (torch.stack(t) for t in zip(
            *(samples[i] for i in range(step * batch, (step + 1) * batch)), strict=True))

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)
    for name, value in model.state_dict().items():
        got = torch.tensor(closure_run[0][name])
        assert torch.allclose(got, value, rtol=1e-4, atol=1e-5), name


def test_a_rank_killed_under_a_closure_optimizer_is_replaced_bitwise(
        tmp_path: Path, closure_run) -> None:
    outs, run = trained(tmp_path, "ck", "tests/programs/closure_steps.py", CLOSURE_STEPS,
                        spares=1, kill_rank=0, kill_after_step=3)
    assert len(outs) == 2, run.logs[-4000:]
    assert len(run.plans) >= 2 and run.plans[-1].layout.dp == 2
    assert outs == closure_run
