"""Expert LB: least-loaded replica choice (checked against the literal greedy rule) and rebalance planning."""

from __future__ import annotations

import torch

from engine.parallel.eplb import Placement, imbalance, rebalance_experts
from engine.parallel.expert_lb import ExpertLB, ExpertLBConfig


def greedy(placement: Placement, layer: int, ids: torch.Tensor, offset: int) -> torch.Tensor:
    """The rule as stated: each assignment, in token order, to its expert's least-loaded replica."""
    _, log2phy, logcnt = placement.maps()
    assigned: dict[int, int] = {}
    out = torch.empty_like(ids)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            n = int(logcnt[layer, e])
            replicas = [int(log2phy[layer, e, (r + offset) % n]) for r in range(n)]
            out[t, j] = min(replicas, key=lambda p: (assigned.get(p, 0), replicas.index(p)))
            assigned[int(out[t, j])] = assigned.get(int(out[t, j]), 0) + 1
    return out


def test_choice_is_least_loaded_replica_and_deterministic():
    load = torch.tensor([[100, 1, 1, 1, 30, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 80]])
    placement = rebalance_experts(load, num_ranks=2, num_redundant=4)
    lb = ExpertLB(placement)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(50)])
    ids[::3, 0] = 0
    for layer in range(2):
        for offset in range(3):
            chosen = lb.choose(layer, ids, offset)
            assert torch.equal(chosen, greedy(placement, layer, ids, offset))
            assert torch.equal(chosen, lb.choose(layer, ids, offset))
    phy2log, _, _ = placement.maps()
    chosen = lb.choose(0, ids)
    assert torch.equal(phy2log[0][chosen], ids)
    hot = chosen[ids == 0]
    per_replica = torch.bincount(hot).tolist()
    assert max(c for c in per_replica if c) - min(c for c in per_replica if c) <= 1


def test_plan_only_when_imbalanced():
    lb = ExpertLB(Placement.contiguous(1, 8, 2), ExpertLBConfig(num_redundant=2, imbalance_threshold=1.05,
                                                                 rebalance_interval_steps=10))
    assert lb.plan(torch.ones(1, 8)) is None
    assert lb.plan(torch.zeros(1, 8)) is None
    plan = lb.plan(torch.tensor([[50.0, 1, 1, 1, 1, 1, 1, 1]]))
    assert plan is not None and plan.num_physical == 10 and plan.phy2log[0].count(0) > 1
    assert not lb.due(0) and not lb.due(5) and lb.due(10)


def test_a_plan_no_better_than_the_current_placement_is_not_applied():
    """Past the threshold, a move is worth its stall only when the plan cuts the imbalance of the same load by
    min_gain: the placement the LB already moved to for this load is not moved to again."""
    skewed = torch.tensor([[100.0, 1, 1, 1, 1, 1, 1, 1]])  # one expert hotter than 2 replicas can even out
    lb = ExpertLB(Placement.contiguous(1, 8, 2), ExpertLBConfig(num_redundant=2, imbalance_threshold=1.0))
    first = lb.plan(skewed)
    assert first is not None and imbalance(first, skewed) < imbalance(lb.placement, skewed)
    lb.set_placement(first)
    assert imbalance(first, skewed) > 1.0  # still over the threshold, so only the gain rule holds it back
    assert lb.plan(skewed) is None  # the same load again: nothing better to move to
