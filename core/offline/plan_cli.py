"""`stalwart plan partition|advise`: the partitioner and the strategy advisor from the shell,
a table for people on stdout and, with --json, one JSON object for programs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stalwart.core.offline.advisor import Cluster, advise
from stalwart.core.partition import partition


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    part = sub.add_parser("partition", help="split layers into pipeline stages, slowest "
                          "stage as fast as possible")
    part.add_argument("--costs", type=_numbers, required=True,
                      help="per-layer cost, comma-separated (seconds, FLOPs, any unit)")
    part.add_argument("--stages", type=int, required=True, help="number of pipeline stages")
    part.add_argument("--speeds", type=_numbers, help="per-stage device speed factors")
    part.add_argument("--mem", type=_numbers, help="per-layer static bytes (params + grads + "
                      "optimizer state)")
    part.add_argument("--act", type=_numbers, help="per-layer activation bytes per micro-batch")
    part.add_argument("--mem-cap", type=_numbers,
                      help="bytes per stage: one number, or one per stage")
    part.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                      help="decides how many micro-batches of activations a stage holds")
    part.add_argument("--micro-batches", type=int, help="micro-batches per step (default: "
                      "the number of stages)")
    part.add_argument("--previous", type=_pairs,
                      help="earlier split as first-last,first-last,... to move few layers from")
    part.add_argument("--json", dest="json_path", type=Path, help="write the result here")

    adv = sub.add_parser("advise", help="choose dp, tp, pp, micro-batches, schedule and "
                         "recomputation for a GPT on a cluster")
    adv.add_argument("--params", type=float, required=True,
                     help="model parameters, e.g. 7e9")
    # Defaults: a node of eight 80 GB H100 SXM GPUs, NVLink 4 (450 GB/s per direction)
    # inside it, one 400 Gb/s NIC per GPU between nodes.
    adv.add_argument("--nodes", type=int, required=True)
    adv.add_argument("--gpus-per-node", type=int, default=8, help="default 8")
    adv.add_argument("--gpu-mem", type=float, default=80.0,
                     help="GPU memory in GB (1e9 bytes); default 80")
    adv.add_argument("--intra-bw", type=float, default=3600.0,
                     help="bandwidth inside a node, Gb/s per GPU per direction; default 3600 "
                          "(NVLink 4)")
    adv.add_argument("--inter-bw", type=float, default=400.0,
                     help="bandwidth between nodes, Gb/s per GPU per direction; default 400")
    adv.add_argument("--global-batch", type=int, default=1024, help="sequences per step")
    adv.add_argument("--gpu-flops", type=float, default=989e12,
                     help="peak 16-bit FLOP/s of one GPU")
    adv.add_argument("--json", dest="json_path", type=Path, help="write the result here")


def run(args: argparse.Namespace) -> int:
    try:
        result = _partition(args) if args.action == "partition" else _advise(args)
    except ValueError as exc:
        print(f"stalwart plan {args.action}: {exc}", file=sys.stderr)
        return 2
    if args.json_path:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _partition(args: argparse.Namespace) -> dict:
    cap = args.mem_cap
    if cap is not None and len(cap) == 1:
        cap = cap[0]
    part = partition(args.costs, args.stages, args.speeds, mem=args.mem, mem_cap=cap,
                     previous=args.previous, act=args.act, schedule=args.schedule,
                     micro_batches=args.micro_batches)
    speeds = args.speeds or [1.0] * args.stages
    rows = [[str(j), f"{a}-{b}", str(b - a + 1), f"{c:.6g}", f"{s:.6g}", f"{t:.6g}"]
            for j, ((a, b), c, s, t) in enumerate(zip(part.stages, part.stage_costs, speeds,
                                                      part.stage_times, strict=True))]
    head = ["stage", "layers", "count", "cost", "speed", "time"]
    if part.stage_memory is not None:
        head.append("memory")
        for row, m in zip(rows, part.stage_memory, strict=True):
            row.append(f"{m:,.0f}")
    print(_table(head, rows))
    mean = sum(part.stage_times) / len(part.stage_times)
    print(f"bottleneck {part.bottleneck:.6g} (max stage time / mean "
          f"{part.bottleneck / mean if mean else 1.0:.3f})")
    out = part.to_json()
    if args.previous is not None:
        out["layers_moved"] = part.layers_moved(args.previous)
        print(f"layers moved from the previous split: {out['layers_moved']}")
    return out


def _advise(args: argparse.Namespace) -> dict:
    cluster = Cluster(gpus_per_node=args.gpus_per_node, nodes=args.nodes,
                      gpu_mem_bytes=args.gpu_mem * 1e9, intra_gbps=args.intra_bw,
                      inter_gbps=args.inter_bw, gpu_flops=args.gpu_flops)
    result = advise(args.params, cluster, global_batch=args.global_batch)
    plans = [result["best"], *result["runner_ups"]]
    rows = [[p["layout"] if "layout" in p else f"dp{p['dp']} tp{p['tp']} pp{p['pp']}",
             p["schedule"], p["recompute"], str(p["micro_batches"]), str(p["accumulation"]),
             f"{p['step_time_s']:.2f}", f"{p['memory_bytes'] / 1e9:.1f}", p["reason"]]
            for p in plans]
    model = result["model"]
    print(f"model: {model['params'] / 1e9:.1f}B params (d_model {model['d_model']}, "
          f"{model['n_layers']} blocks, seq {model['seq']}); cluster: {args.nodes} x "
          f"{args.gpus_per_node} GPUs, {args.gpu_mem:g} GB, {args.intra_bw:g} Gb/s inside a "
          f"node / {args.inter_bw:g} Gb/s between nodes per GPU")
    print(_table(["layout", "schedule", "recompute", "micro-batches", "accum", "step s",
                  "GB/GPU", "why"], rows))
    classic = result["classic"]
    verdict = "agrees" if classic["agrees"] else "disagrees"
    print(f"classic rule: {classic['rule']} -> model {verdict}")
    for line in classic["differences"]:
        print(f"  {line}")
    return result


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [head, *rows]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def _numbers(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}") from None


def _pairs(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(a), int(b)) for a, b in (x.split("-") for x in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected first-last pairs like 0-3,4-7, got {text!r}") from None
