"""Rank bodies of the comm benchmark: timed flat vs hierarchical all-reduce and link
ping-pongs over a two-level node map, and parameter-server vs ring gradient sync.
Run in-process through `client.launch.run_local`, or as `python -m` inside a netns.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

from stalwart.bench.hier_allreduce import collective_times

TIMEOUT = datetime.timedelta(seconds=120)


def _pg(store: Any, key: str, members: list[int], rank: int) -> Any:
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(key + "/", store), members.index(rank),
                                 len(members), TIMEOUT)


def _median_s(fn, barrier, repeats: int) -> float:
    return statistics.median(collective_times(fn, barrier, repeats))


def _ping_pong(pg: Any, me: int, nbytes: int, repeats: int) -> list[float]:
    """One-way seconds for `nbytes` between group members 0 and 1 (half round trips)."""
    import torch

    buf = torch.zeros(max(1, nbytes // 4))
    other = 1 - me

    def once() -> None:
        if me == 0:
            pg.send([buf], other, 7).wait()
            pg.recv([buf], other, 8).wait()
        else:
            pg.recv([buf], other, 7).wait()
            pg.send([buf], other, 8).wait()

    return [t / 2 for t in collective_times(once, lambda: None, repeats)]


def link_figures(pg: Any, me: int, nbytes: int, repeats: int) -> dict[str, float]:
    """Latency (s) and bandwidth (bytes/s) of the path between members 0 and 1 of `pg`."""
    # The fastest tiny round trip is the link; slower ones met a busy CPU (2 cores, 8 ranks).
    latency = min(_ping_pong(pg, me, 4, repeats * 5))
    big = statistics.median(_ping_pong(pg, me, nbytes, repeats))
    return {"latency_s": latency, "bandwidth_Bps": nbytes / max(big - latency, 1e-9)}


def allreduce_body(rank: int, world: int, store: Any, nodes: list[int], nbytes: int,
                   repeats: int) -> dict:
    """Flat vs hierarchical all-reduce of one tensor over every rank; link ping-pongs."""
    import torch

    from stalwart.bench.hier_allreduce import (
        LinkBytes,
        build_hier_groups,
        counting_flat_allreduce,
        hierarchical_allreduce,
    )

    ranks = list(range(world))
    flat_pg = _pg(store, "flat", ranks, rank)
    groups = build_hier_groups(nodes, store=store, rank=rank, tag="hier")
    tensor = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
    barrier = lambda: flat_pg.barrier().wait()  # noqa: E731
    out: dict = {
        "allreduce_s_flat": _median_s(lambda: flat_pg.allreduce([tensor.clone()]).wait(),
                                      barrier, repeats),
        "allreduce_s_hier": _median_s(lambda: hierarchical_allreduce(tensor.clone(), groups),
                                      barrier, repeats),
    }
    counted = LinkBytes()  # one call of each, outside the timing
    groups.counter = counted
    hierarchical_allreduce(tensor.clone(), groups)
    counting_flat_allreduce(tensor.clone(), flat_pg, nodes, rank, counted)
    out["link_bytes"] = counted.as_dict()
    # Link figures: rank 0 with its node neighbour (intra) and with node 1's first rank.
    peers = {"intra": next(r for r in ranks[1:] if nodes[r] == nodes[0]),
             "inter": next(r for r in ranks if nodes[r] != nodes[0])}
    for link, peer in peers.items():
        if rank in (0, peer):
            pair = _pg(store, f"pair-{link}", [0, peer], rank)
            out[link] = link_figures(pair, 0 if rank == 0 else 1, nbytes, max(3, repeats))
        barrier()
    return out


def sync_body(rank: int, world: int, store: Any, nbytes: int, repeats: int) -> dict:
    """Per member count n = 2..world: parameter-server sync vs ring all-reduce, seconds."""
    import torch

    tensor = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
    out: dict = {"ps": {}, "ring": {}}
    for n in range(2, world + 1):
        if rank >= n:
            continue
        members = list(range(n))
        pg = _pg(store, f"sync-{n}", members, rank)
        barrier = lambda pg=pg: pg.barrier().wait()  # noqa: E731
        out["ring"][n] = _median_s(lambda pg=pg: pg.allreduce([tensor.clone()]).wait(),
                                   barrier, repeats)
        out["ps"][n] = _median_s(lambda pg=pg, n=n: _ps_sync(pg, rank, n, tensor.clone()),
                                 barrier, repeats)
    if rank < 2:
        pair = _pg(store, "sync-pair", [0, 1], rank)
        out["link"] = link_figures(pair, rank, nbytes, max(3, repeats))
    return out


def overlap_body(rank: int, world: int, store: Any, width: int, layers: int, batch: int,
                 repeats: int) -> dict:
    """A step of `run()`'s gradient average (client/grad_average.py, the code the user
    loop runs) over every rank, with its buckets summed during backward and after it,
    alternating, on the same model and batch; backward alone and one all-reduce of the
    gradients beside them. Seconds are medians over `repeats` steps of each."""
    import torch

    from stalwart.client.grad_average import GradAverage
    from stalwart.client.parallel_dims import Group

    torch.set_num_threads(1)
    ranks = list(range(world))
    pg = _pg(store, "overlap", ranks, rank)
    group = Group("dp", tuple(ranks), rank, pg)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))

    def build(overlap: bool) -> tuple[torch.nn.Module, GradAverage]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*(m for _ in range(layers)
                                    for m in (torch.nn.Linear(width, width), torch.nn.Tanh())))
        average = GradAverage(list(net.parameters()), [], torch.device("cpu"),
                              bucket_bytes=64 << 20, overlap=overlap)
        average.start(group)
        return net, average

    def step(net: torch.nn.Module, average: GradAverage) -> None:
        for p in net.parameters():
            p.grad = None
        average.arm()
        net(x).square().mean().backward()
        average.average(lambda fn, _what: fn(), world)

    nets = {"overlap": build(True), "after": build(False)}
    alone = build(False)[0]
    barrier = lambda: pg.barrier().wait()  # noqa: E731
    times: dict[str, list[float]] = {"overlap": [], "after": [], "backward": []}
    for i in range(repeats + 1):  # the first round warms up
        for name, (net, average) in nets.items():
            barrier()
            t0 = time.perf_counter()
            step(net, average)
            if i:
                times[name].append(time.perf_counter() - t0)
        barrier()
        t0 = time.perf_counter()
        alone(x).square().mean().backward()
        if i:
            times["backward"].append(time.perf_counter() - t0)
    grads = torch.cat([p.grad.reshape(-1) for p in nets["after"][0].parameters()])
    return {**{k: statistics.median(v) for k, v in times.items()},
            "allreduce": _median_s(lambda: pg.allreduce([grads.clone()]).wait(), barrier,
                                   repeats),
            "overlapped_buckets": nets["overlap"][1].overlapped,
            "buckets": len(nets["overlap"][1].buckets),
            "grad_bytes": grads.numel() * 4,
            "same_result": all(torch.equal(a.grad, b.grad) for a, b in zip(
                nets["overlap"][0].parameters(), nets["after"][0].parameters(), strict=True))}


def _ps_sync(pg: Any, rank: int, n: int, tensor: Any) -> None:
    """Every worker sends its tensor to rank 0, which sums and sends the result back."""
    if rank == 0:
        buf = tensor.clone()
        for src in range(1, n):
            pg.recv([buf], src, 1).wait()
            tensor += buf
        for work in [pg.send([tensor], dst, 2) for dst in range(1, n)]:
            work.wait()
    else:
        pg.send([tensor], 0, 1).wait()
        pg.recv([tensor], 0, 2).wait()


def allreduce_rank(ctx: Any, nodes: list[int], nbytes: int, repeats: int) -> dict:
    """`run_local` entry point (loopback)."""
    return allreduce_body(ctx.rank, ctx.world_size, ctx.store, nodes, nbytes, repeats)


def sync_rank(ctx: Any, nbytes: int, repeats: int) -> dict:
    """`run_local` entry point (loopback)."""
    return sync_body(ctx.rank, ctx.world_size, ctx.store, nbytes, repeats)


def overlap_rank(ctx: Any, width: int, layers: int, batch: int, repeats: int) -> dict:
    """`run_local` entry point (loopback)."""
    return overlap_body(ctx.rank, ctx.world_size, ctx.store, width, layers, batch, repeats)


def main() -> int:
    """Entry point inside a network namespace: host or join the store, run, write JSON."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["allreduce", "sync", "overlap"], required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--nodes", default="", help="allreduce: node of each rank, a,b,c")
    parser.add_argument("--store", required=True, help="HOST:PORT; rank 0 hosts it")
    parser.add_argument("--nbytes", type=int, default=0)
    parser.add_argument("--shape", default="", help="overlap: WIDTH,LAYERS,BATCH")
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), args.world, args.rank == 0, timeout=TIMEOUT,
                          wait_for_workers=False)
    if args.mode == "allreduce":
        nodes = [int(n) for n in args.nodes.split(",")]
        result = allreduce_body(args.rank, args.world, store, nodes, args.nbytes, args.repeats)
    elif args.mode == "sync":
        result = sync_body(args.rank, args.world, store, args.nbytes, args.repeats)
    else:
        width, layers, batch = (int(v) for v in args.shape.split(","))
        result = overlap_body(args.rank, args.world, store, width, layers, batch, args.repeats)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args.out)
    # Rank 0 hosts the store: it leaves last so no peer loses the store mid-run.
    store.add("done", 1)
    if args.rank == 0:
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while store.add("done", 0) < args.world and time.monotonic() < deadline:
            time.sleep(0.01)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
