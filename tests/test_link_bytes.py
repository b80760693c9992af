"""Bytes by link and collective: counted where the collectives run, carried by heartbeats,
exported by the daemon as stalwart_link_bytes_total{link, collective}."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stalwart.client.link_bytes import LinkBytes
from stalwart.client.local_cluster import LocalCluster, wait_until
from stalwart.daemon.rpc.validate import InvalidRequest, request
from stalwart.v1 import rank_pb2


def test_a_ring_counts_what_this_member_sends_to_its_successor() -> None:
    links = LinkBytes()
    links.ring_allreduce("dp_allreduce", ["a", "a", "b", "b"], 1, 1000.0)  # 1 -> 2 crosses
    links.ring_allreduce("dp_allreduce", ["a", "a", "b", "b"], 0, 1000.0)  # 0 -> 1 stays
    links.ring_allgather("tp_allgather", ["a", "b"], 0, 10.0)
    links.ring_allreduce("tp_allreduce", ["a"], 0, 1e9)  # alone: nothing sent
    assert links.drain() == {("inter", "dp_allreduce"): 1500.0,
                             ("intra", "dp_allreduce"): 1500.0,
                             ("inter", "tp_allgather"): 10.0}
    assert links.drain() == {}


@pytest.mark.parametrize("link, collective, nbytes", [
    ("lan", "dp_allreduce", 1.0), ("intra", "DP all-reduce", 1.0),
    ("intra", "x" * 49, 1.0), ("inter", "pp_send", -1.0), ("inter", "pp_send", float("nan"))])
def test_link_bytes_that_would_make_bad_metric_labels_are_refused(link, collective,
                                                                  nbytes) -> None:
    beat = rank_pb2.HeartbeatRequest(rank_id="n0/12", link_bytes=[
        rank_pb2.LinkBytesSent(link=link, collective=collective, bytes=nbytes)])
    with pytest.raises(InvalidRequest, match="link_bytes"):
        request(beat)


def scrape(port: int) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.labels["link"], s.labels["collective"]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "stalwart_link_bytes"
            for s in family.samples if s.name == "stalwart_link_bytes_total"}


@pytest.mark.multiprocess
def test_a_real_run_reports_its_bytes_by_link_through_the_daemons() -> None:
    # dp=2 x pp=2 on 2 nodes of 2 ranks: each node holds one pipeline stage, so DP stays
    # inside a node and every pipeline message crosses between the nodes.
    steps, micro, seq, d_model, micro_batch = 3, 2, 16, 32, 2
    spec = {"model": "tiny", "steps": steps, "faults": [], "collective_timeout_s": 30,
            "model_overrides": {"d_model": d_model, "n_layer": 2, "n_head": 2, "d_ff": 64,
                                "seq_len": seq},
            "train": {"global_batch": 2 * micro * micro_batch, "seed": 0},
            "layout": {"dp": 2, "pp": 2, "tp": 1, "schedule": "1f1b", "microbatches": micro}}
    cluster = LocalCluster(nodes=2, metrics=True)
    try:
        cluster.start_daemons()
        cluster.launch(spec, 4, spares=0, ranks_per_node=2)
        wait_until(lambda: not cluster.running(), 240, "the 4 ranks to finish")
        assert [r.proc.returncode for r in cluster.ranks] == [0, 0, 0, 0]
        first, last = (scrape(n.metrics_port) for n in cluster.daemons)
    finally:
        cluster.close()
    # Activations forward from stage 0 and their gradients back from stage 1: fp32
    # tensors of micro_batch x seq x d_model per micro-batch, from each of 2 ranks.
    per_node = 2 * steps * micro * micro_batch * seq * d_model * 4
    assert first[("inter", "pp_send")] == per_node
    assert last[("inter", "pp_send")] == per_node
    # The last stage hands each step's loss (one float64) to the first stage.
    assert last[("inter", "pp_broadcast")] == 2 * steps * 8
    assert first[("intra", "dp_allreduce")] > 0 and last[("intra", "dp_allreduce")] > 0
    assert ("inter", "dp_allreduce") not in first | last
    assert ("intra", "pp_send") not in first | last
