"""Expert-parallel load balancing (DeepSeek's EPLB): replicate hot experts and place replicas on ranks.

Hierarchical when expert groups divide evenly over nodes: (1) pack expert groups onto nodes so
nodes carry equal load, (2) within each node replicate the experts with the highest load per
replica until the node's physical slots are used, (3) pack the physical experts onto the node's
ranks, equal count per rank, balancing load. Otherwise the same runs globally (one group, one node).
Packing is greedy: heaviest item first, onto the lightest pack that still has room.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class Placement(BaseModel):
    """Which logical expert each physical slot holds, per MoE layer; rank r owns slots [r*S, (r+1)*S)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_logical: int = Field(gt=0, description="routed experts per MoE layer in the checkpoint")
    num_ranks: int = Field(gt=0, description="ranks the physical slots are spread over")
    phy2log: list[list[int]] = Field(description="[moe_layer][physical slot] -> logical expert")

    @model_validator(mode="after")
    def _check(self) -> "Placement":
        widths = {len(row) for row in self.phy2log}
        if not self.phy2log or len(widths) != 1:
            raise ValueError("phy2log must have one equally long row per MoE layer")
        width = widths.pop()
        if width % self.num_ranks:
            raise ValueError(f"phy2log has {width} physical slots, not a multiple of num_ranks ({self.num_ranks})")
        for layer, row in enumerate(self.phy2log):
            if set(row) != set(range(self.num_logical)):
                raise ValueError(f"phy2log[{layer}] must hold every logical expert 0..{self.num_logical - 1} at least once")
        return self

    @property
    def num_layers(self) -> int:
        return len(self.phy2log)

    @property
    def num_physical(self) -> int:
        return len(self.phy2log[0])

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def rank_experts(self, layer: int, rank: int) -> list[int]:
        """Logical experts in `rank`'s slots of MoE layer `layer`, in slot order."""
        s = self.slots_per_rank
        return self.phy2log[layer][rank * s : (rank + 1) * s]

    def maps(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(phy2log [L, P], log2phy [L, E, max replicas] padded with -1, logcnt [L, E])."""
        phy2log = torch.tensor(self.phy2log, dtype=torch.int64)
        logcnt = torch.stack([torch.bincount(row, minlength=self.num_logical) for row in phy2log])
        log2phy = torch.full((self.num_layers, self.num_logical, int(logcnt.max())), -1, dtype=torch.int64)
        for layer, row in enumerate(phy2log.tolist()):
            seen = [0] * self.num_logical
            for phy, log in enumerate(row):
                log2phy[layer, log, seen[log]] = phy
                seen[log] += 1
        return phy2log, log2phy, logcnt

    @classmethod
    def contiguous(cls, num_layers: int, num_logical: int, num_ranks: int) -> "Placement":
        """No replicas: rank r holds experts [r*E/n, (r+1)*E/n) in every layer (the placement without EPLB)."""
        if num_logical % num_ranks:
            raise ValueError(f"{num_logical} experts do not split evenly over {num_ranks} ranks")
        return cls(num_logical=num_logical, num_ranks=num_ranks, phy2log=[list(range(num_logical))] * num_layers)


def rank_loads(placement: Placement, load: torch.Tensor) -> torch.Tensor:
    """[L, ranks] expected load when each expert's tokens split evenly over its replicas."""
    phy2log, _, logcnt = placement.maps()
    per_slot = (load.double() / logcnt).gather(1, phy2log)
    return per_slot.view(placement.num_layers, placement.num_ranks, -1).sum(-1)


def imbalance(placement: Placement, load: torch.Tensor) -> float:
    """Max over layers of max/mean rank load (1.0 is perfect balance)."""
    loads = rank_loads(placement, load)
    mean = loads.mean(1).clamp(min=1e-12)
    return float((loads.max(1).values / mean).max())


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split each row's n items into num_packs packs of n/num_packs items with near-equal weight.

    Returns (pack index [L, n], position within the pack [L, n]).
    """
    layers, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split evenly into {num_packs} packs")
    per_pack = n // num_packs
    pack = torch.empty(layers, n, dtype=torch.int64)
    position = torch.empty(layers, n, dtype=torch.int64)
    for i in range(layers):
        loads, sizes = [0.0] * num_packs, [0] * num_packs
        row = weight[i].tolist()
        for item in sorted(range(n), key=lambda j: -row[j]):
            p = min((q for q in range(num_packs) if sizes[q] < per_pack), key=lambda q: loads[q])
            pack[i, item], position[i, item] = p, sizes[p]
            sizes[p] += 1
            loads[p] += row[item]
    return pack, position


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give every logical expert one slot, then each extra slot to the expert with most load per replica.

    Returns (phy2log [L, P], replica index of each slot [L, P], replica count [L, E]).
    """
    layers, num_logical = weight.shape
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} experts")
    rows = torch.arange(layers)
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(layers, 1) % num_logical
    replica = torch.zeros(layers, num_physical, dtype=torch.int64)
    logcnt = torch.ones(layers, num_logical, dtype=torch.int64)
    for slot in range(num_logical, num_physical):
        hot = (weight / logcnt).max(-1).indices
        phy2log[:, slot] = hot
        replica[:, slot] = logcnt[rows, hot]
        logcnt[rows, hot] += 1
    return phy2log, replica, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=torch.int64).expand(perm.shape))
    return inv


def rebalance_experts_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phy2log [L, P], replica index [L, P], logcnt [L, E]) for `weight` [L, E] expert loads."""
    layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    ranks_per_node = num_ranks // num_nodes
    slots_per_rank = num_physical // num_ranks
    logical_per_node = num_logical // num_nodes

    # 1. groups -> nodes; "meta-logical" ids number experts node by node.
    group_load = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    group_pack, group_position = balanced_packing(group_load, num_nodes)
    group_base = (group_pack * groups_per_node + group_position) * group_size
    log2mlog = (group_base.unsqueeze(-1) + torch.arange(group_size)).flatten(-2)
    mlog2log = _inverse(log2mlog)

    # 2. replicas within each node.
    mlog_load = weight.gather(-1, mlog2log).view(-1, logical_per_node)
    phy2mlog, replica, mlogcnt = replicate_experts(mlog_load, num_physical // num_nodes)

    # 3. physical experts -> ranks within each node.
    phy_load = (mlog_load / mlogcnt).gather(-1, phy2mlog)
    pack, position = balanced_packing(phy_load, ranks_per_node)
    pphy2phy = _inverse(pack * slots_per_rank + position)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    node_base = torch.arange(0, num_logical, logical_per_node).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(layers, num_nodes, -1) + node_base).flatten(-2)
    phy2log = mlog2log.gather(-1, pphy2mlog)
    replica = replica.gather(-1, pphy2phy).view(layers, -1)
    logcnt = mlogcnt.view(layers, -1).gather(-1, log2mlog)
    return phy2log, replica, logcnt


def rebalance_experts(
    load: torch.Tensor, num_ranks: int, num_redundant: int, num_groups: int = 1, num_nodes: int = 1,
) -> Placement:
    """Placement of E + num_redundant physical experts over num_ranks ranks for load [L, E] (token counts)."""
    weight = load.double().cpu()
    layers, num_logical = weight.shape
    num_physical = num_logical + num_redundant
    if num_physical % num_ranks:
        raise ValueError(f"{num_logical} experts + {num_redundant} redundant do not split evenly over {num_ranks} ranks")
    if num_logical % num_groups or num_ranks % num_nodes:
        raise ValueError(f"num_groups ({num_groups}) must divide the experts and num_nodes ({num_nodes}) the ranks")
    if num_groups % num_nodes:
        num_groups = num_nodes = 1  # groups cannot be spread evenly over nodes: balance globally
    phy2log, _, _ = rebalance_experts_hierarchical(weight, num_physical, num_groups, num_nodes, num_ranks)
    return Placement(num_logical=num_logical, num_ranks=num_ranks, phy2log=phy2log.tolist())
