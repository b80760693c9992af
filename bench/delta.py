"""`stalwart bench delta`: how small lossless deltas of real training states get.

Trains GPT presets with AdamW on real text, captures fp32 parameters + optimizer state
as raw bytes after each step, and encodes them with the daemon's codecs: the full base
(shuffle + zstd) is the baseline; variants show what each idea buys. The default codec
XORs against the previous step, with parameters and second moments predicted from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from statistics import median
from types import SimpleNamespace

import numpy as np

from stalwart.bench.progress import say
from stalwart.daemon.snapshot import codecs
from stalwart.daemon.snapshot.chunks import decode_rank, encode_rank, plan_chunks
from stalwart.v1 import manifest_pb2

CHUNK_BYTES = 4 << 20
LR, WEIGHT_DECAY, BATCH = 1e-3, 0.1, 8


def _trainer(preset: str, seed: int = 0):
    import torch

    from stalwart.client.layers import Stage
    from stalwart_examples.gpt import job

    torch.manual_seed(seed)
    layers, data = job(preset, global_batch=BATCH, seed=seed, corpus_bytes=2 << 20)
    model = Stage(layers, 0, len(layers) - 1, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    cursor = SimpleNamespace(position=0)  # optimizer steps taken: the data position

    def step() -> float:
        x, y = data.batch(data.indices(cursor.position))
        cursor.position += 1
        loss = layers.loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return model, opt, cursor, step


def _state_tensors(model, opt) -> list:
    from stalwart.client.state_layout import StateTensor

    out = []
    for name, p in model.named_parameters():
        out.append(StateTensor(name, p.data))
        for key, t in sorted(opt.state[p].items()):
            out.append(StateTensor(f"{name}/{key}", t))
    return out


def _hints(model, opt) -> list[manifest_pb2.AdamWHint]:
    """What the capture hook would send: each parameter's AdamW settings and step."""
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    out = []
    for name, p in model.named_parameters():
        g = group_of[id(p)]
        out.append(manifest_pb2.AdamWHint(
            param=name, exp_avg=f"{name}/exp_avg", exp_avg_sq=f"{name}/exp_avg_sq",
            lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
            weight_decay=g["weight_decay"], step=int(opt.state[p]["step"])))
    return out


def _capture(model, opt) -> tuple[np.ndarray, list]:
    import torch

    from stalwart.client.state_layout import describe, pack_into

    tensors = _state_tensors(model, opt)
    metas, total = describe(tensors)
    buf = torch.zeros(total, dtype=torch.uint8)
    pack_into(buf, tensors, metas)
    return buf.numpy().copy(), metas


def _restore(model, opt, data: np.ndarray, metas: list) -> None:
    import torch

    from stalwart.client.state_layout import unpack

    values = unpack(data.tobytes(), metas)
    with torch.no_grad():
        for st in _state_tensors(model, opt):
            st.tensor.copy_(values[st.name])


def _chunked(cur: np.ndarray, metas: list, code: Callable) -> int:
    """Stored bytes when `code(piece_slice, regions)` encodes every chunk."""
    return sum(len(code(slice(s.offset, s.offset + s.size), list(s.regions)))
               for s in plan_chunks(metas, cur.size, CHUNK_BYTES))


def _variants(cur: np.ndarray, prev: np.ndarray, base: np.ndarray, metas: list,
              hints: list) -> dict:
    """Stored bytes of one step under each encoding idea."""
    def full(lv):
        return lambda sl, regions: codecs.encode_full(cur[sl], regions, level=lv)

    def xor(ref, lv, shuffled=True):
        def code(sl, regions):
            return codecs.encode_xor(cur[sl], ref[sl], regions if shuffled else [], level=lv)
        return code

    predicted = encode_rank(2, 0, cur, metas, chunk_bytes=CHUNK_BYTES, reference=prev,
                            reference_step=1, adamw=hints)
    return {
        "adamw_predicted_xor_prev_default_level": predicted.stored_bytes,
        "base_only_zstd1": _chunked(cur, metas, full(1)),
        "xor_prev_shuffle_zstd1": _chunked(cur, metas, xor(prev, 1)),
        "xor_base_shuffle_zstd1": _chunked(cur, metas, xor(base, 1)),
        "xor_prev_noshuffle_zstd1": _chunked(cur, metas, xor(prev, 1, shuffled=False)),
        "xor_prev_shuffle_zstd3": _chunked(cur, metas, xor(prev, 3)),
        "xor_prev_shuffle_zstd9": _chunked(cur, metas, xor(prev, 9)),
    }


def _throughput(cur: np.ndarray, prev: np.ndarray, metas: list, hints: list,
                repeats: int) -> dict:
    """Encode and decode GB/s of the default codec (AdamW-predicted delta vs previous step)."""
    enc, dec, enc2 = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        encoded = encode_rank(2, 0, cur, metas, chunk_bytes=CHUNK_BYTES, reference=prev,
                              reference_step=1, adamw=hints)
        enc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        record = manifest_pb2.RankState(tensors=metas, chunks=encoded.chunks,
                                        total_bytes=cur.size, adamw=hints)
        decoded = decode_rank(record, encoded.payloads, {1: prev})
        dec.append(time.perf_counter() - t0)
        if not np.array_equal(decoded, cur):
            raise AssertionError("the default codec did not restore the state bitwise")
        with ThreadPoolExecutor(2) as pool:
            t0 = time.perf_counter()
            encode_rank(2, 0, cur, metas, chunk_bytes=CHUNK_BYTES, reference=prev,
                        reference_step=1, adamw=hints, executor=pool)
            enc2.append(time.perf_counter() - t0)
    gb = cur.size / 1e9
    return {"encode_gbps": round(gb / median(enc), 3), "decode_gbps": round(gb / median(dec), 3),
            "encode_2threads_gbps": round(gb / median(enc2), 3)}


def _lossy(captures: list[np.ndarray], metas: list) -> tuple[list[int], np.ndarray]:
    """Stored bytes per step of the opt-in quantised codec, and its last reconstruction."""
    recon, sizes = captures[0], []
    for cur in captures[1:]:
        encoded = encode_rank(2, 0, cur, metas, chunk_bytes=CHUNK_BYTES, reference=recon,
                              reference_step=1, lossy=True)
        sizes.append(encoded.stored_bytes)
        recon = encoded.decoded
    return sizes, recon


def _continue(preset: str, state: np.ndarray, metas: list, position: int,
              steps: int) -> list[float]:
    """Losses of `steps` more training steps started from `state`."""
    model, opt, data, step = _trainer(preset)
    step()  # creates the optimizer state tensors that `state` overwrites
    _restore(model, opt, state, metas)
    data.position = position
    return [step() for _ in range(steps)]


def _preset(preset: str, warmup: int, steps: int, after: int, repeats: int) -> dict:
    model, opt, data, step = _trainer(preset)
    for _ in range(warmup):
        step()
    captures, hints, metas, losses = [], [], None, []
    for _ in range(steps + 1):
        losses.append(step())
        cur, metas = _capture(model, opt)
        captures.append(cur)
        hints.append(_hints(model, opt))
    position = data.position
    per_step = [_variants(cur, prev, captures[0], metas, h)
                for prev, cur, h in zip(captures, captures[1:], hints[1:], strict=False)]
    full_bytes = int(captures[0].size)
    default = [v["adamw_predicted_xor_prev_default_level"] for v in per_step]
    plain = [v["xor_prev_shuffle_zstd1"] for v in per_step]
    base_only = [v["base_only_zstd1"] for v in per_step]
    lossy_sizes, recon = _lossy(captures, metas)
    uninterrupted = [step() for _ in range(after)]
    exact_losses = _continue(preset, captures[-1], metas, position, after)
    lossy_losses = _continue(preset, recon, metas, position, after)
    diffs = [abs(a - b) for a, b in zip(exact_losses, lossy_losses, strict=True)]
    totals = {k: sum(v[k] for v in per_step) for k in per_step[0]}
    return {
        "preset": preset,
        "warmup_steps": warmup,
        "full_bytes": full_bytes,
        "delta_bytes": default,
        "compression_ratio": round(full_bytes * len(default) / sum(default), 3),
        "xor_only_delta_bytes": plain,
        "xor_only_ratio": round(full_bytes * len(plain) / sum(plain), 3),
        "base_only_bytes": base_only,
        "base_only_ratio": round(full_bytes * len(base_only) / sum(base_only), 3),
        "delta_vs_base_only": round(sum(base_only) / sum(default), 3),
        "variant_ratios": {k: round(full_bytes * len(per_step) / v, 3)
                           for k, v in totals.items()},
        **_throughput(captures[-1], captures[-2], metas, hints[-1], repeats),
        # A restore from the exact capture must continue exactly like the original run.
        "exact_restore_same_losses": exact_losses == uninterrupted,
        "lossy": {
            "label": "LOSSY, opt-in: int8 deltas with error feedback; restores are not exact",
            "delta_bytes": lossy_sizes,
            "compression_ratio": round(full_bytes * len(lossy_sizes) / sum(lossy_sizes), 3),
            "max_abs_param_error": float(np.abs(recon.view(np.float32)
                                                - captures[-1].view(np.float32)).max()),
            "continued_steps": after,
            "losses_exact_restore": [round(x, 5) for x in exact_losses],
            "losses_lossy_restore": [round(x, 5) for x in lossy_losses],
            "max_abs_loss_diff": round(max(diffs), 6),
            "final_loss_rel_diff": round(diffs[-1] / exact_losses[-1], 6),
        },
        "train_losses_during_capture": [round(x, 4) for x in losses],
    }


def run(quick: bool) -> dict:
    import torch

    # Two intra-op threads make CPU training differ run to run in the last bits; one
    # thread keeps runs bitwise repeatable, so loss differences come from restores only.
    torch.set_num_threads(1)
    if quick:
        plan = [("tiny", 10, 4, 5)]
    else:
        plan = [("tiny", 30, 10, 20), ("small", 30, 8, 10)]
    results = {}
    for name, warmup, steps, after in plan:
        say(f"{name}: {warmup} warm-up steps, then {steps} captured steps")
        results[name] = _preset(name, warmup, steps, after, 1 if quick else 3)
    return {
        "chunk_bytes": CHUNK_BYTES,
        "codec": "ADAM_PREDICTED_XOR_ZSTD_V2: XOR against the previous step, parameters and "
                 "second moments against their AdamW update predicted from it; byte-plane "
                 f"shuffle; zstd level {codecs.DEFAULT_LEVEL} (the daemon's); the other "
                 "variants use the levels their names give",
        "baseline": "base_only: byte-plane shuffle + zstd level 1 of the full state",
        "presets": results,
    }
