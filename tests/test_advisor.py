"""The strategy advisor reproduces the classic sizing rules on their own ground and says
where its cost model departs from them."""

from __future__ import annotations

import functools

import pytest

from stalwart.core.costs import shape_for_params
from stalwart.core.offline.advisor import Cluster, _candidates, advise, classic_rule

GB = 1e9


@functools.cache
def advice(params: float, inter_gbps: float, nodes: int = 32) -> dict:
    # 8 x H100-80GB nodes with NVLink (450 GB/s per direction per GPU).
    return advise(params, Cluster(gpus_per_node=8, nodes=nodes, gpu_mem_bytes=80 * GB,
                                  intra_gbps=3600, inter_gbps=inter_gbps))


def test_7b_on_fast_links_is_data_parallel_and_the_rule_agrees():
    result = advice(7e9, 800)
    best = result["best"]
    assert best["dp"] >= 8 * best["tp"] * best["pp"]
    assert best["pp"] == 1
    assert result["classic"]["agrees"]
    assert result["classic"]["rule_plan"]["tp"] == 1  # pure DP is among the equals


def test_70b_splits_layers_inside_a_node_and_replicates_across_nodes():
    best = advice(70e9, 800)["best"]
    assert best["tp"] >= 2
    assert best["tp"] * best["pp"] <= 8  # all model parallelism stays inside a node
    assert best["dp"] >= 16


def test_70b_the_model_says_where_tp8_loses_to_a_shallow_pipeline():
    classic = advice(70e9, 800)["classic"]
    assert classic["rule_plan"]["tp"] == 8 and classic["rule_plan"]["pp"] == 1
    if not classic["agrees"]:
        assert "TP all-reduces" in classic["differences"][0]


def test_400b_needs_data_tensor_and_pipeline_parallelism():
    result = advice(400e9, 800)
    best = result["best"]
    assert best["dp"] > 1 and best["tp"] > 1 and best["pp"] > 1
    assert result["classic"]["agrees"]
    without_pp = [p for p in result["rejected"] if p["pp"] == 1]
    assert without_pp and all("does not fit" in p["reason"] for p in without_pp)


def test_slow_inter_node_links_favour_pipelines_over_data_parallel_traffic():
    fast, slow = advice(7e9, 800)["best"], advice(7e9, 100)["best"]
    assert fast["pp"] == 1 and slow["pp"] > 1
    assert slow["dp"] < fast["dp"]


def test_tensor_parallel_groups_never_cross_a_node():
    shape = shape_for_params(70e9)
    for gpus_per_node in (2, 4, 8):
        cluster = Cluster(gpus_per_node=gpus_per_node, nodes=4, gpu_mem_bytes=80 * GB,
                          intra_gbps=3600, inter_gbps=200)
        plans = _candidates(shape, cluster, 1024)
        assert plans
        for plan in plans:
            assert gpus_per_node % plan.tp == 0
            assert plan.dp * plan.tp * plan.pp == cluster.gpus


def test_every_plan_shown_fits_in_gpu_memory_and_explains_itself():
    result = advice(70e9, 200)
    for plan in [result["best"], *result["runner_ups"]]:
        assert plan["fits"] and plan["memory_bytes"] <= 0.9 * 80 * GB
        assert plan["reason"]
        t = plan["time_s"]
        pipeline = t["compute"] + t["tp_comm"] + t["pp_comm"] + t["bubble"]
        assert plan["step_time_s"] == pytest.approx(pipeline + t["dp_exposed"], rel=1e-6)
    slower = [p["step_time_s"] for p in result["runner_ups"]]
    assert slower == sorted(slower) and slower[0] >= result["best"]["step_time_s"]


def test_a_model_too_big_for_the_cluster_is_refused_with_the_memory_needed():
    with pytest.raises(ValueError, match=r"no layout fits 16 GB GPUs: the smallest needs"):
        advise(400e9, Cluster(gpus_per_node=8, nodes=1, gpu_mem_bytes=16 * GB,
                              intra_gbps=3600, inter_gbps=200))


@pytest.mark.parametrize("params, gbps, uses", [
    (7e9, 800, ["dp"]),
    (70e9, 800, ["dp", "tp"]),
    (400e9, 800, ["dp", "pp", "tp"]),
    (7e9, 100, ["dp", "pp"]),
])
def test_classic_rule_as_usually_stated(params, gbps, uses):
    assert classic_rule(params, gbps)["uses"] == uses
