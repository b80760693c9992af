"""The Llama example (entry shape 2: RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU) on real daemons: pipeline and tensor parallelism follow one trajectory, a
SIGKILLed rank is replaced by a spare bitwise, and without a spare the job shrinks onto
the survivor keeping the trajectory. The TP split of the model itself is checked in
one process."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from example_runs import Run, run_example
from torch import nn

from stalwart_examples.llama import config, job
from stalwart_examples.llama.model import TP_PLAN, DecoderBlock

MODULE = "stalwart_examples.llama.train"
STEPS = 12
ARGS = ("--d-model", "32", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2",
        "--d-ff", "64", "--seq-len", "16", "--steps", str(STEPS), "--global-batch", "8",
        "--corpus-bytes", "65536")
TOLERANCE = 1e-4  # relative: fp32, the same sums in another pipeline/TP arrangement


def layout(pp: int, tp: int) -> tuple[str, ...]:
    return (*ARGS, "--pp", str(pp), "--tp", str(tp))


def assert_same_losses(run: Run, baseline: Run, steps: range) -> None:
    for step in steps:
        assert run.losses[step] == pytest.approx(baseline.losses[step], rel=TOLERANCE), step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int], Run]:
    """The failure-free run of a (pp, tp) layout on pp * tp ranks, run once when first asked."""
    done: dict[tuple[int, int], Run] = {}

    def get(pp: int, tp: int) -> Run:
        if (pp, tp) not in done:
            run = run_example(tmp_path_factory.mktemp(f"pp{pp}tp{tp}"), MODULE,
                              *layout(pp, tp), world=pp * tp)
            assert len(run.finished()) == pp * tp, run.logs[-4000:]
            done[pp, tp] = run
        return done[pp, tp]

    return get


# In one process: the model's tensor-parallel split -----------------------------------


def test_a_kv_head_count_that_does_not_split_over_tp_is_refused() -> None:
    cfg = config("tiny", n_head=6, n_kv_head=3, d_model=96)
    cfg.check_tp(3)
    with pytest.raises(ValueError, match=r"n_kv_head=3 key/value heads do not split over "
                                         r"tp=2.*whole key/value heads"):
        cfg.check_tp(2)
    with pytest.raises(ValueError, match=r"n_kv_head=2 .* tp=4"):
        job("tiny", tp=4, n_kv_head=2, corpus_bytes=65536)


def test_query_heads_must_share_kv_heads_evenly() -> None:
    with pytest.raises(ValueError, match=r"n_head=4 .* n_kv_head=3"):
        config("tiny", n_kv_head=3)


def _tp_slice(block: DecoderBlock, rank: int, tp: int) -> DecoderBlock:
    """`block` as TP rank `rank` holds it under TP_PLAN (Megatron's split)."""
    local = copy.deepcopy(block)
    for path, style in TP_PLAN.items():
        full = block.get_submodule(path)
        weight = full.weight.detach().chunk(tp, 0 if style == "column" else 1)[rank]
        part = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        part.weight.data.copy_(weight)
        parent, _, leaf = path.rpartition(".")
        setattr(local.get_submodule(parent), leaf, part)
    return local


@pytest.mark.parametrize("tp", [1, 2])
def test_grouped_attention_and_swiglu_split_over_tp_sum_to_the_full_block(tp: int) -> None:
    cfg = config("tiny", d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, seq_len=16)
    torch.manual_seed(0)
    block = DecoderBlock(cfg)
    x = torch.randn(3, cfg.seq_len, cfg.d_model)
    shards = [_tp_slice(block, r, tp) for r in range(tp)]
    with torch.no_grad():
        for part in ("attn", "mlp"):
            full = getattr(block, part)(x)
            partial_sum = sum(getattr(s, part)(x) for s in shards)
            torch.testing.assert_close(partial_sum, full, rtol=1e-5, atol=1e-6)


# On real daemons ---------------------------------------------------------------------

@pytest.mark.multiprocess
def test_pipeline_and_tensor_parallel_runs_follow_one_trajectory(uninterrupted) -> None:
    pipeline = uninterrupted(2, 1)
    assert sorted(pipeline.losses) == list(range(1, STEPS + 1))
    assert pipeline.losses[STEPS] < pipeline.losses[1] - 0.5
    assert_same_losses(uninterrupted(1, 2), pipeline, range(1, STEPS + 1))
    assert_same_losses(uninterrupted(2, 2), pipeline, range(1, STEPS + 1))


@pytest.mark.multiprocess
def test_a_killed_rank_of_a_2x2_grid_is_replaced_by_a_spare_bitwise(tmp_path: Path,
                                                                    uninterrupted) -> None:
    # Ranks 2 and 3 (stage 1's TP group) and the spare share node 1: a TP group stays on
    # one node, so only a spare there can take a place in it.
    run = run_example(tmp_path, MODULE, *layout(2, 2), nodes=2, world=4, spares=1,
                      kill_rank=2, kill_after_step=5)
    assert len(run.finished()) == 4, run.logs[-4000:]
    plan = run.plans[-1]
    assert run.committed_at_kill is not None and plan.resume_step >= run.committed_at_kill
    assert (plan.layout.dp, plan.layout.pp, plan.layout.tp) == (1, 2, 2)
    assert run.digest() == uninterrupted(2, 2).digest()
    assert run.losses == uninterrupted(2, 2).losses


@pytest.mark.multiprocess
def test_without_a_spare_the_pipeline_shrinks_onto_the_survivor(tmp_path: Path,
                                                                 uninterrupted) -> None:
    run = run_example(tmp_path, MODULE, *layout(2, 1), world=2, kill_rank=1,
                      kill_after_step=5)
    assert len(run.finished()) == 1, run.logs[-4000:]
    plan = run.plans[-1]
    assert (plan.layout.dp, plan.layout.pp, plan.layout.tp) == (1, 1, 1)
    assert run.committed_at_kill is not None
    assert run.committed_at_kill <= plan.resume_step < STEPS
    assert run.finished()[0]["steps"] == STEPS
    assert_same_losses(run, uninterrupted(2, 1), range(plan.resume_step + 1, STEPS + 1))
