"""`stalwart bench NAME [--quick] --json PATH`: run one benchmark (or `all`)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

# name -> one-line description; the module is stalwart.bench.<name>
BENCHMARKS: dict[str, str] = {
    "pipeline": "bubble fraction and peak activation memory of 1F1B vs GPipe",
    "partition": "balanced vs uniform pipeline partition on measured layer costs",
    "capture": "training stall per capture vs torch.save and DCP async_save",
    "delta": "lossless delta compression of real training states",
    "erasure": "Reed-Solomon coder throughput, storage ratio, restore from shards",
    "recovery": "time to recover from a killed rank vs restart-all + checkpoint load",
    "elastic": "shrinking a 4-stage pipeline onto 3 survivors",
    "scale": "per-step commit with up to 2,048 simulated daemons; re-planning at 16k GPUs",
    "comm": "cross-node bytes under topology-aware placement; hierarchical all-reduce",
    "gpu": "CUDA capture stall vs DCP pinned async_save, restore, NVML, NCCL abort (GPU)",
    "fuzz": "random, mutated and undecodable inputs to every RPC, with and without credentials",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=[*BENCHMARKS, "all"], help="benchmark to run")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--json", dest="json_path", type=Path, required=True,
                        help="file to write the figures to (one JSON object)")


def run_one(name: str, quick: bool) -> dict:
    from stalwart.bench import progress

    module = importlib.import_module(f"stalwart.bench.{name}")
    started = time.time()
    progress.begin(name)
    figures = module.run(quick=quick)
    return {
        "benchmark": name,
        "quick": quick,
        "started_unix": round(started, 3),
        "elapsed_s": round(time.time() - started, 3),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        **figures,
    }


def run(args: argparse.Namespace) -> int:
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    results = {}
    for name in names:
        print(f"[bench] {name}: {BENCHMARKS[name]} ...", file=sys.stderr, flush=True)
        try:
            results[name] = run_one(name, args.quick)
        except ModuleNotFoundError as exc:
            if args.name != "all" or exc.name != f"stalwart.bench.{name}":
                raise
            print(f"[bench] {name}: not implemented yet, skipped", file=sys.stderr)
    for name, figures in results.items():
        print(f"[bench] {name}: done in {figures['elapsed_s']:.1f} s; {_headline(figures)}",
              file=sys.stderr)
    out = results[names[0]] if args.name != "all" else results
    args.json_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json_path.with_suffix(args.json_path.suffix + ".tmp")
    tmp.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    tmp.replace(args.json_path)
    print(f"[bench] wrote {args.json_path}", file=sys.stderr)
    return 0


def _headline(figures: dict, most: int = 6) -> str:
    """The first few top-level numbers of a benchmark's figures, for its closing line."""
    skip = {"started_unix", "elapsed_s", "quick"}
    shown = [f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4g}" for k, v in figures.items()
             if k not in skip and isinstance(v, int | float) and not isinstance(v, bool)]
    return ", ".join(shown[:most]) or "see the JSON"
