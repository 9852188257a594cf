"""EPLB on Zipf-skewed loads: replicas + packing bring max/mean rank load to <= 1.05."""

from __future__ import annotations

import time

import pytest
import torch
from pydantic import ValidationError

from engine.parallel.eplb import Placement, balanced_packing, imbalance, rebalance_experts, replicate_experts

EXPERTS, RANKS, REDUNDANT, LAYERS = 64, 8, 8, 4


def zipf_load(s: float, seed: int = 0) -> torch.Tensor:
    """[LAYERS, EXPERTS] token counts: expert popularity ~ 1/rank^s, a different hot set per layer."""
    g = torch.Generator().manual_seed(seed)
    shape = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64) ** s
    return torch.stack([(shape[torch.randperm(EXPERTS, generator=g)] * 1e6).round() for _ in range(LAYERS)])


@pytest.mark.parametrize("s", [1.0, 1.5])
def test_eplb_balances_zipf_load(s):
    load = zipf_load(s)
    before = imbalance(Placement.contiguous(LAYERS, EXPERTS, RANKS), load)
    t0 = time.perf_counter()
    placement = rebalance_experts(load, RANKS, REDUNDANT)
    seconds = time.perf_counter() - t0
    after = imbalance(placement, load)
    print(f"zipf s={s}: max/mean rank load {before:.3f} without EPLB -> {after:.4f} with EPLB "
          f"({EXPERTS} experts + {REDUNDANT} redundant on {RANKS} ranks, {LAYERS} layers, placed in {seconds * 1e3:.1f} ms)")
    assert before > 1.5
    assert after <= 1.05
    phy2log, log2phy, logcnt = placement.maps()
    assert phy2log.shape == (LAYERS, EXPERTS + REDUNDANT)
    assert int(logcnt.sum(1).unique()) == EXPERTS + REDUNDANT
    hottest = load.argmax(1)
    assert (logcnt[torch.arange(LAYERS), hottest] > 1).all()
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            slots = [p for p in log2phy[layer, expert].tolist() if p >= 0]
            assert len(slots) == logcnt[layer, expert]
            assert all(phy2log[layer, p] == expert for p in slots)


def test_hierarchical_keeps_each_group_on_one_node():
    load = zipf_load(1.0, seed=3)
    placement = rebalance_experts(load, num_ranks=8, num_redundant=8, num_groups=8, num_nodes=2)
    half = placement.num_physical // 2
    for row in placement.phy2log:
        node_groups = [{e // 8 for e in row[:half]}, {e // 8 for e in row[half:]}]
        assert not node_groups[0] & node_groups[1]
        assert len(node_groups[0]) == len(node_groups[1]) == 4
    assert imbalance(placement, load) < imbalance(Placement.contiguous(LAYERS, EXPERTS, 8), load)


def test_groups_not_dividing_nodes_fall_back_to_global():
    load = zipf_load(1.5, seed=4)
    assert rebalance_experts(load, 8, 8, num_groups=4, num_nodes=8) == rebalance_experts(load, 8, 8)


def test_replicate_and_pack_primitives():
    phy2log, replica, logcnt = replicate_experts(torch.tensor([[10.0, 1.0, 4.0]]), 6)
    assert logcnt.tolist() == [[3, 1, 2]]
    assert sorted(zip(phy2log[0].tolist(), replica[0].tolist())) == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1)]
    pack, position = balanced_packing(torch.tensor([[5.0, 4.0, 3.0, 3.0, 2.0, 1.0]]), 2)
    sums = [sum(w for w, p in zip([5, 4, 3, 3, 2, 1], pack[0].tolist()) if p == k) for k in range(2)]
    assert sums == [9, 9]
    assert sorted(position[0].tolist()) == [0, 0, 1, 1, 2, 2]


def test_placement_validation_names_the_problem():
    with pytest.raises(ValidationError, match="every logical expert"):
        Placement(num_logical=4, num_ranks=2, phy2log=[[0, 1, 2, 2]])
    with pytest.raises(ValidationError, match="multiple of num_ranks"):
        Placement(num_logical=3, num_ranks=2, phy2log=[[0, 1, 2]])
    with pytest.raises(ValueError, match="do not split evenly"):
        rebalance_experts(torch.ones(1, 8), num_ranks=3, num_redundant=0)
