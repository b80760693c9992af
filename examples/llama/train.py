"""Train the Llama-style decoder with Stalwart's DP x PP x TP loop, protected (start it
with a launcher, one process per rank and spare)."""

from __future__ import annotations

import argparse

import stalwart
from stalwart_examples.llama import job


def main(argv: list[str] | None = None) -> None:
    a = argparse.ArgumentParser(description=__doc__).add_argument
    a("--model", default="tiny", help="preset: tiny, small or medium; the flags below "
      "override its fields")
    for flag in ("--d-model", "--n-layer", "--n-head", "--n-kv-head", "--d-ff", "--seq-len"):
        a(flag, type=int, default=None)
    a("--steps", type=int, default=40)
    a("--pp", type=int, default=1)
    a("--tp", type=int, default=1)
    a("--schedule", default="1f1b")
    a("--microbatches", type=int, default=None)
    a("--global-batch", type=int, default=8)
    a("--seed", type=int, default=0)
    a("--corpus-bytes", type=int, default=4 << 20)
    a("--lr", type=float, default=3e-3)
    a("--recompute", default="none", help="none, selective (the attention core) or full")
    a("--collective-timeout", type=float, default=10.0, help="seconds")
    args = a.__self__.parse_args(argv)

    shape = {k: v for k in ("d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "seq_len")
             if (v := getattr(args, k)) is not None}
    layers, data = job(args.model, tp=args.tp, global_batch=args.global_batch,
                       seed=args.seed, corpus_bytes=args.corpus_bytes, **shape)
    result = stalwart.run_layers(
        layers, data, steps=args.steps, pp=args.pp, tp=args.tp, schedule=args.schedule,
        microbatches=args.microbatches, collective_timeout_s=args.collective_timeout,
        seed=args.seed, lr=args.lr, min_lr=args.lr / 10, recompute=args.recompute)
    if result is not None:
        print(f"trained {result.steps} steps; param_digest {result.param_digest}")


if __name__ == "__main__":
    main()
