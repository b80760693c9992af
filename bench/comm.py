"""`stalwart bench comm`: cross-node bytes of a 3D-parallel GPT step under round-robin vs
topology-aware placement (model), flat vs hierarchical all-reduce (model and measured over
two bandwidth-limited network namespaces), and parameter-server vs ring sync (measured).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stalwart.core import comm_model as cm
from stalwart.core.rank_placement import Layout, Placement, naive_placement, place
from stalwart.core.topology import Link, Topology

CLUSTER = Topology(nodes=4, devices_per_node=8)
LAYOUT = Layout(dp=4, pp=2, tp=4)
# A GPT of ~1.3 B parameters (24 layers, hidden 2048) on 2048-token sequences.
SHAPE = cm.GPTShape(layers=24, hidden=2048, seq_len=2048, vocab=50257, micro_batch=1,
                    micro_batches=8)
INTER_RATE_MBIT = 400  # tc tbf rate of the emulated inter-node link


def run(quick: bool) -> dict:
    out = placement_figures()
    ranks_per_node = 2 if quick else 4
    nbytes = (4 if quick else 16) << 20
    out.update(measured_allreduce(ranks_per_node, nbytes, repeats=3 if quick else 5))
    sync_bytes = (1 if quick else 4) << 20
    out.update(measured_sync(8, sync_bytes, repeats=3 if quick else 5))
    return out


def placement_figures() -> dict:
    """Modelled bytes of one training step that cross node boundaries, by placement."""
    naive = naive_placement(LAYOUT, CLUSTER)
    placed = place(LAYOUT, CLUSTER, cost=lambda p: cm.cross_node_bytes(p, SHAPE, "ring"))
    naive_b = cm.cross_node_bytes(naive, SHAPE, "ring")
    placed_b = cm.cross_node_bytes(placed, SHAPE, "ring")
    flat = cm.step_traffic(placed, SHAPE, "ring")["dp_allreduce"].inter
    hier = cm.step_traffic(placed, SHAPE, "hier")["dp_allreduce"].inter
    return {
        "cluster": CLUSTER.to_dict(),
        "layout": {"dp": LAYOUT.dp, "pp": LAYOUT.pp, "tp": LAYOUT.tp},
        "gpt_shape": {"layers": SHAPE.layers, "hidden": SHAPE.hidden, "seq_len": SHAPE.seq_len,
                      "vocab": SHAPE.vocab, "micro_batch": SHAPE.micro_batch,
                      "micro_batches": SHAPE.micro_batches, "act_bytes": SHAPE.act_bytes,
                      "grad_bytes": SHAPE.grad_bytes},
        "placement_strategy": placed.strategy,
        "cross_node_bytes_naive": naive_b,
        "cross_node_bytes_placed": placed_b,
        "cross_node_reduction": 1 - placed_b / naive_b,
        "cross_node_bytes_by_collective": {"naive": _by_collective(naive),
                                           "placed": _by_collective(placed)},
        "cross_node_bytes_placed_hier": cm.cross_node_bytes(placed, SHAPE, "hier"),
        "allreduce_cross_node_bytes_flat": flat,
        "allreduce_cross_node_bytes_hier": hier,
        "allreduce_cross_node_reduction": 1 - hier / flat,
        "modeled_step_comm_s": {"naive_flat": cm.step_comm_s(naive, SHAPE, "ring"),
                                "placed_flat": cm.step_comm_s(placed, SHAPE, "ring"),
                                "placed_hier": cm.step_comm_s(placed, SHAPE, "hier")},
    }


def _by_collective(p: Placement) -> dict[str, float]:
    return {k: v.inter for k, v in cm.step_traffic(p, SHAPE, "ring").items()}


def measured_allreduce(ranks_per_node: int, nbytes: int, repeats: int) -> dict:
    """Flat vs hierarchical all-reduce over 2 emulated nodes, in the same run."""
    nodes = [0] * ranks_per_node + [1] * ranks_per_node
    why_not = _netns_unavailable()
    if why_not is None:
        ranks, link = _run_in_netns(nodes, nbytes, repeats), (
            f"2 network namespaces joined by veth, tc tbf {INTER_RATE_MBIT} Mbit/s each way "
            f"(10.77.0.0/24); ranks of one namespace talk over its loopback path")
    else:
        from stalwart.bench.comm_worker import allreduce_rank
        from stalwart.client.launch import run_local

        ranks = run_local(allreduce_rank, len(nodes), nodes, nbytes, repeats, timeout=180.0,
                          env={"OMP_NUM_THREADS": "1"})
        link = f"loopback fallback, inter-node link NOT limited ({why_not})"
    flat = max(r["allreduce_s_flat"] for r in ranks)
    hier = max(r["allreduce_s_hier"] for r in ranks)
    intra, inter = ranks[0]["intra"], ranks[0]["inter"]
    topo = Topology(nodes=2, devices_per_node=ranks_per_node,
                    intra=Link(bandwidth=intra["bandwidth_Bps"], latency=intra["latency_s"]),
                    inter=Link(bandwidth=inter["bandwidth_Bps"], latency=inter["latency_s"]))
    return {
        "allreduce_link_emulation": link,
        "allreduce_nodes": f"2 x {ranks_per_node}",
        "allreduce_tensor_bytes": nbytes,
        "allreduce_s_flat": flat,
        "allreduce_s_hier": hier,
        "allreduce_hier_speedup": flat / hier,
        "measured_links": {"intra": intra, "inter": inter},
        "modeled_allreduce_s_flat": cm.ring_allreduce_s(topo, nodes, nbytes),
        "modeled_allreduce_s_hier": cm.hier_allreduce_s(topo, nodes, nbytes),
    }


def measured_sync(world: int, nbytes: int, repeats: int) -> dict:
    """Parameter server (reduce to rank 0, broadcast) vs ring all-reduce for 2..world ranks."""
    from stalwart.bench.comm_worker import sync_rank
    from stalwart.client.launch import run_local

    ranks = run_local(sync_rank, world, nbytes, repeats, timeout=180.0,
                      env={"OMP_NUM_THREADS": "1"})
    counts = range(2, world + 1)
    # A collective ends when its slowest member does.
    ps = {n: max(r["ps"][str(n)] for r in ranks if str(n) in r["ps"]) for n in counts}
    ring = {n: max(r["ring"][str(n)] for r in ranks if str(n) in r["ring"]) for n in counts}
    fig = ranks[0]["link"]
    link = Link(bandwidth=fig["bandwidth_Bps"], latency=fig["latency_s"])
    one_node = Topology(nodes=1, devices_per_node=128, intra=link)

    def saving(n: int, size: float) -> float:
        return 1 - cm.ring_allreduce_s(one_node, [0] * n, size) / cm.ps_sync_s(link, n, size)

    return {
        "sync_tensor_bytes": nbytes,
        "sync_link": "loopback (gloo over TCP on this machine)",
        "sync_s_ps": {str(n): ps[n] for n in counts},
        "sync_s_ring": {str(n): ring[n] for n in counts},
        "sync_ring_saving_measured": {str(n): 1 - ring[n] / ps[n] for n in counts},
        "sync_link_measured": fig,
        "modeled_sync_s_ps": {str(n): cm.ps_sync_s(link, n, nbytes) for n in counts},
        "modeled_sync_s_ring": {str(n): cm.ring_allreduce_s(one_node, [0] * n, nbytes)
                                for n in counts},
        "modeled_ring_saving_128": saving(128, nbytes),
        "modeled_ring_saving_128_by_tensor_bytes": {
            str(size): saving(128, size) for size in (4 << 10, 64 << 10, 1 << 20, 16 << 20,
                                                      256 << 20)},
    }


def _netns_unavailable() -> str | None:
    """None when network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    probe = f"stwc-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if subprocess.run(["tc", "-V"], capture_output=True).returncode != 0:
        return "tc is not installed"
    return None


def _sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


def _run_in_netns(nodes: list[int], nbytes: int, repeats: int) -> list[dict]:
    """Two namespaces joined by a rate-limited veth; one worker process per rank."""
    tag = f"{os.getpid() % 100000}"
    ns = [f"stwc-{tag}-0", f"stwc-{tag}-1"]
    veth = [f"stwc{tag}a", f"stwc{tag}b"]
    addr = ["10.77.0.1", "10.77.0.2"]
    procs: list[subprocess.Popen] = []
    try:
        for name in ns:
            _sh("ip", "netns", "add", name)
        _sh("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i in range(2):
            _sh("ip", "link", "set", veth[i], "netns", ns[i])
            _sh("ip", "-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", veth[i])
            _sh("ip", "-n", ns[i], "link", "set", "lo", "up")
            _sh("ip", "-n", ns[i], "link", "set", veth[i], "up")
            _sh("tc", "-n", ns[i], "qdisc", "add", "dev", veth[i], "root", "tbf", "rate",
                f"{INTER_RATE_MBIT}mbit", "burst", "256kb", "latency", "200ms")
        with tempfile.TemporaryDirectory(prefix="stalwart-comm-") as tmp:
            outs = [Path(tmp) / f"rank{r}.json" for r in range(len(nodes))]
            for r, node in enumerate(nodes):
                env = {**os.environ, "GLOO_SOCKET_IFNAME": veth[node], "OMP_NUM_THREADS": "1"}
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns[node], sys.executable, "-m",
                     "stalwart.bench.comm_worker", "--rank", str(r),
                     "--nodes", ",".join(map(str, nodes)), "--store", f"{addr[0]}:29777",
                     "--nbytes", str(nbytes), "--repeats", str(repeats), "--out", str(outs[r])],
                    env=env, stdout=subprocess.DEVNULL,
                    stderr=(Path(tmp) / f"rank{r}.err").open("w")))
            _wait_all(procs, Path(tmp), deadline=time.monotonic() + 240)
            return [json.loads(p.read_text()) for p in outs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        for name in ns:  # deleting a namespace removes its end of the veth pair too
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _wait_all(procs: list[subprocess.Popen], logs: Path, deadline: float) -> None:
    """Poll until every worker exits; the first failure or the deadline raises."""
    while any(p.poll() is None for p in procs):
        for r, p in enumerate(procs):
            if p.returncode not in (None, 0):
                tail = (logs / f"rank{r}.err").read_text()[-3000:]
                raise RuntimeError(f"comm worker rank {r} exited with {p.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError("comm workers did not finish before the deadline; the "
                               "namespaces are removed, rerun to retry")
        time.sleep(0.05)
    for r, p in enumerate(procs):
        if p.returncode != 0:
            tail = (logs / f"rank{r}.err").read_text()[-3000:]
            raise RuntimeError(f"comm worker rank {r} exited with {p.returncode}:\n{tail}")
