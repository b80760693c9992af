"""`stalwart train`: train the GPT example with DP x PP x TP as local rank processes,
unprotected (no daemon, no snapshots: a tool to compare layouts and precisions), and
report the global loss of every step and a layout-independent digest of the parameters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["configure", "run", "train_worker"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="micro-batches per pipeline round (default: pp)")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="pipeline rounds accumulated per optimizer step")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps to run")
    parser.add_argument("--model", choices=["tiny", "small", "medium"], default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16", "auto"], default="fp32")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--compress", choices=["none", "fp16", "bf16"], default="none",
                        help="gradient dtype on the wire for the data-parallel sum")
    parser.add_argument("--grad-clip", type=float, default=0.0,
                        help="clip the global gradient L2 norm to this (0: no clipping)")
    parser.add_argument("--bounds", default=None,
                        help="stage bounds as inclusive layer ranges, e.g. 0-1,2-5 "
                             "(default: uniform)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU per rank (LOCAL_RANK), NCCL groups")
    parser.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    parser.add_argument("--json", dest="json_path", type=Path, default=None,
                        help="write losses and param_digest here")


class UsageError(ValueError):
    """A flag's value cannot work; the message names the flag and a value that would."""


def parse_bounds(text: str | None) -> list[list[int]] | None:
    """--bounds "0-1,2-5" as [[0, 1], [2, 5]]."""
    if not text:
        return None
    try:
        out = [[int(x) for x in part.split("-")] for part in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(b) != 2 for b in out):
        raise UsageError(f"--bounds {text!r}: give inclusive FIRST-LAST block ranges, one per "
                         "stage, e.g. --bounds 0-1,2-3")
    return out


def preflight(args: argparse.Namespace, layers: Any = None) -> list[str]:
    """Check the flags in this process before any rank starts: raise UsageError (one line
    naming the flag) when they cannot work, return warnings for slow or substituted
    choices. `layers` defaults to the GPT example of --model."""
    import torch

    from stalwart.client.tensor_parallel import plan_errors
    from stalwart.client.trainer import TrainConfig, check_layout, resolve_precision
    from stalwart.core.layout import Layout
    from stalwart_examples.gpt import config
    from stalwart_examples.gpt.model import layers as gpt_layers

    for flag, value in (("--steps", args.steps), ("--global-batch", args.global_batch),
                        ("--grad-accum", args.grad_accum), ("--log-every", args.log_every)):
        if value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    try:
        layout = Layout(dp=args.dp, pp=args.pp, tp=args.tp)
    except ValueError as e:
        raise UsageError(f"--dp/--pp/--tp: {e}") from None
    layers = layers if layers is not None else gpt_layers(config(args.model))
    try:
        check_layout(len(layers), layout, global_batch=args.global_batch,
                     microbatches=args.microbatches or args.pp, grad_accum=args.grad_accum,
                     bounds=parse_bounds(args.bounds))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.tp > 1:
        with torch.device("meta"):  # shapes only: nothing is allocated
            for i, name in enumerate(layers.names):
                errors = plan_errors(layers.build(i, 0), layers.tp_plan, args.tp, name)
                if errors:
                    divisors = [d for d in range(1, args.tp * 8 + 1)
                                if not plan_errors(layers.build(i, 0), layers.tp_plan, d, name)]
                    raise UsageError(f"--tp {args.tp}: {errors[0]} (--tp "
                                     f"{max(d for d in divisors if d < args.tp)} works)")
    if args.device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have == 0:
            raise UsageError("--device cuda: torch sees no CUDA device on this machine "
                             f"(torch {torch.__version__}); use --device cpu")
        if have < layout.world_size:
            raise UsageError(f"--device cuda: {layout.world_size} ranks need one GPU each, this "
                             f"machine has {have}; lower --dp/--pp/--tp")
    try:  # what every rank builds, refused here rather than in each of them
        TrainConfig(seed=args.seed, lr=args.lr, min_lr=args.lr / 10, decay_steps=args.steps,
                    precision=args.precision, recompute=args.recompute,
                    compress=args.compress, grad_clip=args.grad_clip)
    except ValueError as exc:
        raise UsageError(f"--{str(exc).replace('_', '-')}") from None
    warning = resolve_precision(args.precision, args.device)[1]
    return [warning] if warning else []


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    bounds = parse_bounds(args.bounds)
    return {"dp": args.dp, "pp": args.pp, "tp": args.tp, "schedule": args.schedule,
            "microbatches": args.microbatches or args.pp, "grad_accum": args.grad_accum,
            "steps": args.steps, "model": args.model, "seed": args.seed,
            "global_batch": args.global_batch, "lr": args.lr, "precision": args.precision,
            "recompute": args.recompute, "compress": args.compress, "bounds": bounds,
            "grad_clip": args.grad_clip,
            "log_every": args.log_every, "device": args.device}


def train_worker(ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of `stalwart train`: returns its losses and (dp=0) parameter hashes."""
    import torch

    from stalwart.client.parallel_dims import ParallelDims
    from stalwart.client.trainer import TrainConfig, Trainer
    from stalwart.core.layout import Layout
    from stalwart_examples.gpt import job

    device = torch.device("cpu")
    if spec["device"] == "cuda":
        device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dims = ParallelDims(Layout(dp=spec["dp"], pp=spec["pp"], tp=spec["tp"]),
                        world_size=ctx.world_size)
    dims.build(ctx.store, ctx.rank, 0, backend="nccl" if device.type == "cuda" else "gloo")
    cfg = TrainConfig(seed=spec["seed"], lr=spec["lr"], min_lr=spec["lr"] / 10,
                      decay_steps=spec["steps"], precision=spec["precision"],
                      recompute=spec["recompute"], compress=spec["compress"],
                      grad_clip=spec.get("grad_clip", 0.0))
    layers, data = job(spec["model"], global_batch=spec["global_batch"], seed=spec["seed"])
    trainer = Trainer(dims, layers, data, cfg, stage_bounds=spec["bounds"],
                      schedule=spec["schedule"],
                      microbatches=spec["microbatches"], grad_accum=spec["grad_accum"],
                      device=device)
    losses = []
    started = time.perf_counter()
    for step in range(spec["steps"]):
        losses.append(trainer.step())
        if ctx.rank == 0 and (step % spec["log_every"] == 0 or step == spec["steps"] - 1):
            print(f"step {step + 1:5d}  loss {losses[-1]:.4f}  "  # steps count from 1
                  f"{time.perf_counter() - started:7.1f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - started
    hashes = trainer.param_hashes()  # collective over TP: every rank calls it
    me = dims.my
    trainer.close()
    dims.destroy()
    return {"losses": losses, "seconds": seconds,
            "hashes": hashes if me.dp == 0 and me.tp == 0 else {}}


def run(args: argparse.Namespace) -> int:
    from stalwart.client.digest import param_digest
    from stalwart.client.launch import RankFailure, run_local
    from stalwart_examples.gpt import config

    try:
        warnings = preflight(args)
    except UsageError as e:
        print(f"stalwart train: {e}", file=sys.stderr)
        return 2
    spec = _spec(args)
    world = args.dp * args.pp * args.tp
    print(f"[train] unprotected loop (no daemon, no snapshots): {args.model} GPT, "
          f"dp={args.dp} pp={args.pp} tp={args.tp} "
          f"({world} ranks), {args.schedule} m={spec['microbatches']}, {args.steps} steps, "
          f"precision {args.precision}, recompute {args.recompute}, device {args.device}",
          file=sys.stderr, flush=True)
    for warning in warnings:
        print(f"[train] note: {warning}", file=sys.stderr, flush=True)
    try:
        results = run_local(train_worker, world, spec, timeout=args.timeout)
    except RankFailure as exc:
        from stalwart.cli import debugging

        if debugging():
            print(f"stalwart train: the run failed.\n{exc}", file=sys.stderr)
        else:
            print(f"stalwart train: {exc.summary} (`stalwart --debug train ...` shows every "
                  "rank's traceback)", file=sys.stderr)
        return 1
    hashes: dict[str, str] = {}
    for res in results:
        hashes.update(res["hashes"])
    cfg = config(args.model)
    seconds = results[0]["seconds"]
    out = {"losses": results[0]["losses"], "param_digest": param_digest(hashes),
           "layout": {"dp": args.dp, "pp": args.pp, "tp": args.tp},
           "config": spec, "seconds": round(seconds, 3),
           "tokens_per_s": round(args.steps * args.global_batch * cfg.seq_len / seconds, 1)}
    print(f"[train] final loss {out['losses'][-1]:.4f}  param_digest {out['param_digest'][:16]}"
          f"  {out['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    if args.json_path:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps(out, indent=2) + "\n")
    return 0
