"""Train the GPT with Stalwart's DP x PP x TP loop, protected (start it with a launcher:
`stalwart demo` does, one process per rank and spare)."""

from __future__ import annotations

import argparse
import json

import stalwart
from stalwart_examples.gpt import job


def bounds(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.split("-")) for part in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    a = argparse.ArgumentParser(description=__doc__).add_argument
    a("--model", default="tiny", help="preset: tiny, small or medium")
    a("--model-overrides", type=json.loads, default={}, help="JSON of GPTConfig fields")
    a("--steps", type=int, default=40)
    a("--pp", type=int, default=1)
    a("--tp", type=int, default=1)
    a("--schedule", default="1f1b")
    a("--microbatches", type=int, default=None)
    a("--grad-accum", type=int, default=1)
    a("--bounds", type=bounds, default=None, help="stage bounds, e.g. 0-1,2-5")
    a("--global-batch", type=int, default=8)
    a("--seed", type=int, default=0)
    a("--corpus-bytes", type=int, default=4 << 20)
    a("--lr", type=float, default=3e-3)
    a("--precision", default="fp32")
    a("--recompute", default="none")
    a("--grad-clip", type=float, default=0.0)
    a("--collective-timeout", type=float, default=10.0)
    a("--flops-costs", action="store_true", help="plan with FLOPs, not measured times")
    args = a.__self__.parse_args(argv)

    layers, data = job(args.model, global_batch=args.global_batch, seed=args.seed,
                       corpus_bytes=args.corpus_bytes, flops_costs=args.flops_costs,
                       **args.model_overrides)
    result = stalwart.run_layers(
        layers, data, steps=args.steps, pp=args.pp, tp=args.tp, schedule=args.schedule,
        microbatches=args.microbatches, grad_accum=args.grad_accum, stage_bounds=args.bounds,
        collective_timeout_s=args.collective_timeout, seed=args.seed, lr=args.lr,
        min_lr=args.lr / 10, precision=args.precision, recompute=args.recompute,
        grad_clip=args.grad_clip)
    if result is not None:
        print(f"trained {result.steps} steps; param_digest {result.param_digest}")


if __name__ == "__main__":
    main()
