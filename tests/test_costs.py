"""Layer cost profiles: analytic counts of a GPT, recomputation trade-offs, JSON round trip,
and per-layer times measured on this device."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core.costs import CostProfile, GPTShape, gpt_profile, shape_for_params

GPT2_SMALL = GPTShape(vocab=50257, d_model=768, n_layers=12, n_heads=12, seq=1024,
                      micro_batch=1)


def test_gpt2_small_has_its_known_parameter_count():
    # 124M with tied embeddings; the untied LM head a pipeline's last stage holds adds V*h.
    assert GPT2_SMALL.params() - 50257 * 768 == pytest.approx(124.4e6, rel=0.01)


def test_embedding_and_head_are_layers_of_their_own_and_the_head_is_heavy():
    profile = gpt_profile(GPT2_SMALL)
    kinds = [x.kind for x in profile.layers]
    assert kinds == ["embedding"] + ["block"] * 12 + ["head"]
    costs = profile.costs("flops")
    assert costs[-1] > 3 * costs[1] > 100 * costs[0]


def test_recomputation_trades_activation_bytes_for_flops():
    block = gpt_profile(GPT2_SMALL).layers[1]
    assert block.act_bytes["none"] > block.act_bytes["selective"] > block.act_bytes["full"]
    assert block.flops("none") < block.flops("selective") < block.flops("full")
    assert block.flops("full") == pytest.approx(block.flops("none") * 4 / 3)


def test_profile_survives_a_json_round_trip(tmp_path: Path):
    profile = gpt_profile(GPT2_SMALL)
    profile.layers[3].fwd_s = 0.25
    path = tmp_path / "costs.json"
    profile.save(path)
    again = CostProfile.load(path)
    assert again == profile


def test_measured_costs_are_required_when_asked_for():
    with pytest.raises(ValueError, match="no measured time"):
        gpt_profile(GPT2_SMALL).costs("measured")


@pytest.mark.parametrize("params", [7e9, 70e9, 400e9])
def test_shape_for_params_lands_near_the_requested_size(params):
    shape = shape_for_params(params)
    assert shape.params() == pytest.approx(params, rel=0.1)
    assert shape.n_heads % 8 == 0  # TP up to a whole 8-GPU node divides the heads


def test_the_measured_probe_of_the_gpt_example_has_times_params_and_the_activation():
    torch = pytest.importorskip("torch", reason="measuring blocks needs torch")
    from stalwart.client.layers import Activation, probe
    from stalwart_examples.gpt import config, job

    torch.manual_seed(0)
    cfg = config("tiny")
    layers, data = job(cfg, global_batch=2, corpus_bytes=1 << 16)
    inputs, targets = data.batch(data.indices(0))
    probes, act = probe(layers, inputs, targets, repeats=1)
    assert len(probes) == cfg.num_layers
    assert act == (Activation((cfg.seq_len, cfg.d_model), torch.float32),) * (cfg.num_layers - 1)
    assert all(p.fwd_s > 0 and p.bwd_s > 0 for p in probes)
    assert [p.sharded for p in probes] == [False] + [True] * cfg.n_layer + [False]
    assert sum(p.params for p in probes) == GPTShape(
        vocab=cfg.vocab, d_model=cfg.d_model, n_layers=cfg.n_layer, n_heads=cfg.n_head,
        seq=cfg.seq_len, d_ff=cfg.d_ff).params()


def test_a_blocks_bytes_count_what_adamw_trains_four_times_and_frozen_state_once():
    torch = pytest.importorskip("torch", reason="measuring blocks needs torch")
    from stalwart.client.layers import block_bytes

    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 2, bias=False).to(torch.bfloat16),
                                torch.nn.Linear(4, 4, bias=False))
    block[2].requires_grad_(False)
    block[3].weight = block[0].weight  # tied: held once
    block[1].register_buffer("cache", torch.zeros(3), persistent=False)
    trained = (16 + 4 + 4 + 4) * 4  # fp32: the first linear and BatchNorm's affine
    kept = 4 * 4 + 4 * 4 + 8 + 8 * 2  # running mean and var, the batch count, bf16 weight
    assert block_bytes(block) == (4 * trained + kept + 3 * 4, 3 * trained + kept)
