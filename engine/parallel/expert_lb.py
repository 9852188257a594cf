"""The expert LB: picks which replica serves each token's expert, and decides when to rebalance.

Replica choice is least-loaded by the tokens already assigned in the current step, ties to the
lowest replica. Every replica starts a step at zero, so this greedy rule is exactly round robin
over an expert's replicas in token order, computed here without a Python loop. Each rank starts
its round robin at a different replica so the remainders of different ranks do not pile onto the
first replica. The choice depends only on the step's routing: results are reproducible.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from engine.parallel.eplb import Placement, imbalance, rebalance_experts


class ExpertLBConfig(BaseModel):
    """When and how the expert LB re-plans the placement."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_redundant: int = Field(0, ge=0, description="physical slots beyond one per logical expert, per layer")
    num_groups: int = Field(1, gt=0, description="expert groups for hierarchical EPLB (1: global)")
    num_nodes: int = Field(1, gt=0, description="nodes the ranks span, for hierarchical EPLB")
    rebalance_interval_steps: int = Field(1000, gt=0, description="steps between rebalance checks")
    imbalance_threshold: float = Field(1.1, ge=1.0, description="rebalance only when max/mean rank load exceeds this")
    min_gain: float = Field(0.05, ge=0.0, lt=1.0, description="and only when the new placement would cut the max/mean "
                                                              "rank load of the same window by this share: moving "
                                                              "experts costs the steps it stalls, so a plan no better "
                                                              "than the current one is not applied")


class ExpertLB:
    """Maps logical expert ids to physical slots under the current placement."""

    def __init__(self, placement: Placement, config: ExpertLBConfig | None = None) -> None:
        self.config = config or ExpertLBConfig()
        self.set_placement(placement)

    def set_placement(self, placement: Placement) -> None:
        self.placement = placement
        _, self.log2phy, self.logcnt = placement.maps()

    def choose(self, layer: int, topk_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Physical slot ids [T, k] for logical `topk_ids` [T, k] of MoE layer `layer`."""
        flat = topk_ids.reshape(-1).cpu()
        order = torch.argsort(flat, stable=True)
        sorted_ids = flat[order]
        counts = torch.bincount(sorted_ids, minlength=self.placement.num_logical)
        first = torch.cumsum(counts, 0) - counts
        occurrence = torch.empty_like(flat)
        occurrence[order] = torch.arange(flat.numel()) - first[sorted_ids]
        replica = (occurrence + offset) % self.logcnt[layer, flat]
        return self.log2phy[layer, flat, replica].view(topk_ids.shape).to(topk_ids.device)

    def due(self, step: int) -> bool:
        return step > 0 and step % self.config.rebalance_interval_steps == 0

    def plan(self, load: torch.Tensor) -> Placement | None:
        """A new placement for window load [L, E], or None when the current one is within the threshold."""
        if float(load.sum()) == 0 or imbalance(self.placement, load) <= self.config.imbalance_threshold:
            return None
        c = self.config
        planned = rebalance_experts(load, self.placement.num_ranks, c.num_redundant, c.num_groups, c.num_nodes)
        if imbalance(planned, load) > (1.0 - c.min_gain) * imbalance(self.placement, load):
            return None
        return planned
