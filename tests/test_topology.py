"""Topology description and the analytic communication model built on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.core.costs import GPTShape
from stalwart.core.layout import Layout
from stalwart.core.offline import comm_model as cm
from stalwart.core.rank_placement import naive_placement, place
from stalwart.core.topology import Link, Topology, load_topology

TOPO = Topology(nodes=2, devices_per_node=4, intra=Link(bandwidth=100.0, latency=0.0),
                inter=Link(bandwidth=10.0, latency=0.0))


def test_devices_are_numbered_node_major_and_links_follow_nodes() -> None:
    assert [TOPO.node_of(d) for d in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert TOPO.link(0, 3) is TOPO.intra
    assert TOPO.link(3, 4) is TOPO.inter
    with pytest.raises(ValueError, match="device 8 is outside"):
        TOPO.node_of(8)


def test_topology_loads_from_toml_section_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "cluster.toml"
    toml.write_text("[topology]\nnodes = 3\ndevices_per_node = 2\nnics_per_node = 2\n"
                    "[topology.inter]\nbandwidth = 1.25e9\nlatency = 2e-5\n")
    topo = load_topology(toml)
    assert (topo.nodes, topo.devices_per_node, topo.nics_per_node) == (3, 2, 2)
    assert topo.inter == Link(bandwidth=1.25e9, latency=2e-5)
    js = tmp_path / "cluster.json"
    js.write_text(json.dumps(topo.to_dict()))
    assert load_topology(js) == topo


def test_unknown_topology_keys_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text('{"nodes": 1, "devices_per_node": 1, "gpus": 8}')
    with pytest.raises(ValueError, match=r"unknown topology keys \['gpus'\]"):
        load_topology(bad)


def test_concurrent_inter_node_flows_share_the_nics() -> None:
    topo = Topology(nodes=2, devices_per_node=8, nics_per_node=2,
                    inter=Link(bandwidth=10.0, latency=0.0))
    assert topo.inter_flow_bandwidth(1) == 10.0
    assert topo.inter_flow_bandwidth(2) == 10.0
    assert topo.inter_flow_bandwidth(8) == 2.5


def test_ring_allreduce_sends_2_n_minus_1_over_n_of_the_tensor_per_rank() -> None:
    traffic = cm.ring_allreduce([0, 0, 1, 1], 100.0)  # 2 ring edges cross nodes
    assert traffic.intra + traffic.inter == pytest.approx(4 * 2 * 3 / 4 * 100)
    assert traffic.inter == pytest.approx(2 * 150.0)


def test_hierarchical_allreduce_sends_only_1_over_g_of_the_tensor_across_nodes() -> None:
    nodes = [0] * 4 + [1] * 4
    hier, flat = cm.hier_allreduce(nodes, 800.0), cm.ring_allreduce(nodes, 800.0)
    assert hier.inter == pytest.approx(8 * 2 * (1 / 2) * 800 / 4)  # = 2 (k-1) S
    assert flat.inter == pytest.approx(2 * 2 * 7 / 8 * 800)
    assert hier.inter < flat.inter


def test_hierarchical_allreduce_with_uneven_nodes_goes_through_leaders() -> None:
    traffic = cm.hier_allreduce([0, 0, 0, 1], 10.0)
    assert traffic.intra == pytest.approx(2 * 2 * 10)
    assert traffic.inter == pytest.approx(2 * 10)


def test_parameter_server_moves_the_whole_tensor_through_the_root() -> None:
    traffic = cm.ps_sync([0, 0, 1, 1], 10.0)
    assert (traffic.intra, traffic.inter) == (20.0, 40.0)
    link = Link(bandwidth=10.0, latency=0.0)
    assert cm.ps_sync_s(link, 4, 10.0) == pytest.approx(2 * 3 * 10 / 10)


def test_ring_time_is_bound_by_the_slowest_edge_of_each_round() -> None:
    nodes = [0] * 4 + [1] * 4
    # each round moves S/8 over the two cross edges at 10 B/s
    assert cm.ring_allreduce_s(TOPO, nodes, 80.0) == pytest.approx(14 * 10 / 10)
    # intra phases at 100 B/s, then one ring per local index over 2 nodes; 4 flows share 1 NIC
    hier = 2 * 3 * (20 / 100) + 2 * 1 * (80 / 4 / 2 / (10 / 4))
    assert cm.hier_allreduce_s(TOPO, nodes, 80.0) == pytest.approx(hier)


def test_step_traffic_keeps_tp_off_the_network_when_placed() -> None:
    topo, layout = Topology(nodes=4, devices_per_node=8), Layout(dp=4, pp=2, tp=4)
    step = cm.TrainingStep(shape=GPTShape(vocab=100, d_model=64, n_layers=4, n_heads=4, seq=16))
    placed = cm.step_traffic(place(layout, topo), step)
    naive = cm.step_traffic(naive_placement(layout, topo), step)
    assert placed["tp_allreduce"].inter == 0.0
    assert naive["tp_allreduce"].inter > 0.0
    total = {k: v.intra + v.inter for k, v in placed.items()}
    assert total == pytest.approx({k: v.intra + v.inter for k, v in naive.items()})
