"""One rank of a DEP<n> instance: attention for its own requests, a shard of every MoE layer's experts.

Step protocol: every rank calls `step` for every step of the instance, with its own batch or an
empty one. The ranks first agree (all_reduce) whether anyone has work; if so a rank without work
runs an empty pass that still joins each MoE layer's dispatch/combine, so collectives always pair
up layer by layer. `rebalance` is also collective and runs between steps: KV caches are untouched,
only expert weights move (from the peer holding them), so in-flight requests continue unchanged.

A move is all or nothing across the instance: the ranks agree that each has the memory for the new weights beside
the old ones, exchange the rows, stage every layer's new weights, and agree again before any rank swaps them in.
A refused or failed move keeps the old placement everywhere (logged, counted in `failed_moves`): mixed placements
would send tokens to the wrong experts.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.parallel.eplb import Placement, rebalance_experts
from engine.parallel.expert_lb import ExpertLB, ExpertLBConfig
from engine.core.kv_cache import available_memory, num_blocks_for_budget
from engine.model.config import read_config
from engine.model.loader import load_model
from engine.core.model_runner import ModelRunner, SeqStep
from engine.parallel.dispatch import Exchange, ExchangeKind, ExpertDispatch, as_bytes, from_bytes
from engine.parallel.dist import DistConfig
from engine.parallel.expert_load import ExpertLoadStats
from tideflow_kernels.tiles import from_tiles, to_tiles

log = logging.getLogger(__name__)


class DEPConfig(BaseModel):
    """What every rank of a DEP instance loads and how its experts are balanced."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: str = Field(description="Hugging Face checkpoint directory")
    dtype: str | None = Field(None, description="override config.json's dtype (float32 | bfloat16)")
    num_blocks: int | None = Field(64, gt=0, description="KV cache blocks per rank; None: sized from the budget below "
                                                         "once this rank's weights are loaded")
    kv_cache_bytes: int | None = Field(None, gt=0, description="with num_blocks None: the KV cache's bytes per rank")
    kv_cache_fraction: float | None = Field(None, gt=0.0, le=0.95,
                                            description="with num_blocks None: the fraction of the memory left after "
                                                        "the weights (free GPU memory on cuda, available host memory on cpu)")
    block_size: int = Field(16, gt=0, description="tokens per KV block")
    exchange: ExchangeKind = Field("alltoall", description="dispatch/combine transport (see engine.parallel.dispatch)")
    window_steps: int = Field(64, gt=0, description="sliding window of the expert load statistics, in steps")
    lb: ExpertLBConfig = Field(default_factory=ExpertLBConfig, description="expert LB / EPLB settings")

    @model_validator(mode="after")
    def _one_size(self) -> "DEPConfig":
        if self.num_blocks is None and (self.kv_cache_bytes is None) == (self.kv_cache_fraction is None):
            raise ValueError("with num_blocks None, give exactly one of kv_cache_bytes and kv_cache_fraction")
        return self


class DEPRank:
    """Loads this rank's experts, installs the dispatcher on every MoE layer, runs lockstep steps."""

    def __init__(self, dist_config: DistConfig, config: DEPConfig, placement: Placement | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.rank, self.world = dist_config.rank, dist_config.world_size
        self.device = dist_config.torch_device
        model_config = read_config(config.model_dir, config.dtype)
        self.moe_index = [i for i in range(model_config.num_layers) if model_config.is_moe_layer(i)]
        placement = placement or initial_placement(len(self.moe_index), model_config.num_experts, self.world,
                                                   config.lb.num_redundant)
        if placement.num_ranks != self.world or placement.num_layers != len(self.moe_index):
            raise ValueError(f"placement is for {placement.num_ranks} ranks x {placement.num_layers} MoE layers; "
                             f"this instance has {self.world} ranks x {len(self.moe_index)} MoE layers")
        shards: list[list[int]] = [[] for _ in range(model_config.num_layers)]
        for j, layer in enumerate(self.moe_index):
            shards[layer] = placement.rank_experts(j, self.rank)
        self.model = load_model(config.model_dir, config.dtype, self.device, expert_ids=shards)
        self.config = self.model.config
        self.runner = ModelRunner(self.model, self._num_blocks(config), config.block_size)
        self.exchange = Exchange(config.exchange, self.rank, self.world, self.device)
        self.dispatch = ExpertDispatch(self.exchange, placement.slots_per_rank)
        self.lb = ExpertLB(placement, config.lb)
        self.stats = ExpertLoadStats(len(self.moe_index), self.config.num_experts, config.window_steps, registry)
        self.steps = 0
        self.failed_moves = 0  # rebalances refused or failed: the old placement kept
        for j, moe in enumerate(self.model.moe_layers()):
            moe.dispatcher = partial(self._dispatch, j)
            moe.load_observer = partial(self.stats.observe, j)

    def _num_blocks(self, config: DEPConfig) -> int:
        """The KV cache's blocks, sized after the weights (and this rank's expert shard) took their memory:
        sized before, a fraction of free GPU memory would count the weights' memory twice and run out."""
        if config.num_blocks is not None:
            return config.num_blocks
        return num_blocks_for_budget(self.config, config.block_size, self.device, kv_cache_bytes=config.kv_cache_bytes,
                                     kv_cache_fraction=config.kv_cache_fraction)

    @property
    def placement(self) -> Placement:
        return self.lb.placement

    def _dispatch(self, layer: int, x, weights, ids, experts):
        return self.dispatch(x, weights, self.lb.choose(layer, ids, offset=self.rank), experts)

    def step(self, seqs: list[SeqStep]) -> torch.Tensor:
        """Collective. Logits [len(seqs), vocab] for this rank's sequences ([0, vocab] with none)."""
        empty = torch.empty(0, self.config.vocab_size, device=self.device)
        if self._sum(int(bool(seqs))) == 0:
            return empty
        if seqs:
            logits = self.runner.step(seqs)
        else:
            self._empty_pass()
            logits = empty
        self.stats.end_step()
        self.steps += 1
        return logits

    def _empty_pass(self) -> None:
        """Join every MoE layer's dispatch/combine with zero tokens, in layer order."""
        c = self.config
        x = torch.empty(0, c.hidden_size, dtype=c.torch_dtype, device=self.device)
        weights = torch.empty(0, c.experts_per_token, dtype=c.torch_dtype, device=self.device)
        ids = torch.empty(0, c.experts_per_token, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            for moe in self.model.moe_layers():
                moe.dispatcher(x, weights, ids, moe.experts)

    def _sum(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t)
        return int(t)

    def global_load(self) -> torch.Tensor:
        """Collective. [MoE layers, experts] window load summed over all ranks."""
        load = self.stats.window_load().to(self.device)
        if self.world > 1:
            dist.all_reduce(load)
        return load.cpu()

    def rebalance(self, placement: Placement | None = None) -> Placement | None:
        """Collective. Apply `placement`, or the expert LB's plan for the global load; returns what was applied.

        Rank 0 plans and broadcasts, so every rank applies the same placement.
        """
        if placement is None:
            load = self.global_load()
            placement = self.lb.plan(load) if self.rank == 0 else None
            flag = torch.tensor([placement is not None], dtype=torch.int64, device=self.device)
            if self.world > 1:
                dist.broadcast(flag, 0)
            if not int(flag):
                return None
            width = self.config.num_experts + self.lb.config.num_redundant
            table = torch.tensor(placement.phy2log if placement else [[0] * width] * len(self.moe_index),
                                 dtype=torch.int64, device=self.device)
            if self.world > 1:
                dist.broadcast(table, 0)
            placement = Placement(num_logical=self.config.num_experts, num_ranks=self.world, phy2log=table.tolist())
        needed, free = self._staging_bytes(placement), available_memory(self.device)
        if not self._all(needed <= free):
            return self._kept(placement, f"refused: rank {self.rank} stages {needed} bytes of expert weights with "
                                         f"{free} free" if needed > free else "refused: a peer lacks the memory")
        try:
            staged = self._stage_weights(placement)
        except Exception as exc:  # this rank cannot build the new weights: no rank swaps them in
            log.exception("DEP rank %d: staging the new expert placement failed", self.rank)
            staged, why = None, f"failed on rank {self.rank}: {exc}"
        if not self._all(staged is not None):
            return self._kept(placement, why if staged is None else "failed on a peer")
        self._swap_in(placement, staged)
        return placement

    def _all(self, ok: bool) -> bool:
        """Collective: whether every rank says ok."""
        if self.world == 1:
            return ok
        t = torch.tensor([int(ok)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(int(t))

    def _kept(self, placement: Placement, why: str) -> None:
        self.failed_moves += 1
        log.warning("DEP rank %d: expert rebalance to %d physical experts not applied (%s); the old placement stays",
                    self.rank, placement.num_physical, why)
        return None

    def _staging_bytes(self, new: Placement) -> int:
        """This rank's new expert weights, held beside the old ones until the swap."""
        per_expert = sum(e.w13[0].numel() * e.w13.element_size() + e.w2[0].numel() * e.w2.element_size()
                         for e in (moe.experts for moe in self.model.moe_layers()))
        return new.slots_per_rank * per_expert

    def _stage_weights(self, new: Placement) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Collective (one exchange): every layer's new w13 and w2 for this rank's slots: copies of experts it
        already holds, the rest received from their holder. Nothing is swapped in yet."""
        old = self.lb.placement
        moes = self.model.moe_layers()
        plan: list[tuple[int, int, int, int, int]] = []  # (layer, dst rank, dst slot, src rank, src slot)
        for j in range(new.num_layers):
            holders = [old.rank_experts(j, r) for r in range(self.world)]
            for dst in range(self.world):
                for slot, expert in enumerate(new.rank_experts(j, dst)):
                    src = dst if expert in holders[dst] else min(r for r in range(self.world) if expert in holders[r])
                    plan.append((j, dst, slot, src, holders[src].index(expert)))
        counts = torch.zeros(self.world, self.world, dtype=torch.int64)
        chunks: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        for j, dst, _, src, src_slot in plan:
            if src != dst:
                counts[src, dst] += 1
                if src == self.rank:
                    chunks[dst].append(self._expert_row(moes[j].experts, src_slot))
        width = self._expert_row(moes[0].experts, 0).shape[1]
        empty = torch.empty(0, width, dtype=torch.uint8, device=self.device)
        inbox = [iter(b) for b in self.exchange.exchange([torch.cat(c) if c else empty for c in chunks], counts)]
        staged = []
        for j, moe in enumerate(moes):
            e = moe.experts
            rows = []
            for layer, dst, slot, src, src_slot in plan:
                if layer == j and dst == self.rank:
                    rows.append(self._expert_row(e, src_slot) if src == dst else next(inbox[src]).unsqueeze(0))
            split = e.w13[0].numel() * e.w13.element_size()
            flat = torch.cat(rows)
            w13 = from_bytes(flat[:, :split], e.w13.dtype).view(-1, *e.w13.shape[1:])
            w2 = from_bytes(flat[:, split:], e.w2.dtype).view(-1, *e.w2.shape[1:])
            if e.tiled:  # the rows travel row-major (_expert_row); this rank keeps its experts tiled
                w13, w2 = to_tiles(w13), to_tiles(w2)
            staged.append((w13, w2))
        return staged

    def _swap_in(self, new: Placement, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every layer's staged weights and slot map at once, then the dispatcher's and the expert LB's."""
        for j, (moe, (w13, w2)) in enumerate(zip(self.model.moe_layers(), staged)):
            e = moe.experts
            e.w13 = torch.nn.Parameter(w13, requires_grad=False)
            e.w2 = torch.nn.Parameter(w2, requires_grad=False)
            e.local_experts = new.rank_experts(j, self.rank)
            local_of = torch.full_like(e.local_of, -1)
            for slot, expert in reversed(list(enumerate(e.local_experts))):
                local_of[expert] = slot
            e.local_of = local_of
        self.dispatch.slots = new.slots_per_rank
        self.lb.set_placement(new)

    @staticmethod
    def _expert_row(experts, slot: int) -> torch.Tensor:
        """One expert's w13 and w2 as a single [1, bytes] row, row-major whatever layout this rank keeps them
        in: ranks on hosts with and without AMX tiles (tideflow_kernels.tiles) read each other's rows alike."""
        w13, w2 = experts.w13[slot : slot + 1], experts.w2[slot : slot + 1]
        if experts.tiled:
            w13, w2 = from_tiles(w13), from_tiles(w2)
        return torch.cat((as_bytes(w13.reshape(1, -1)), as_bytes(w2.reshape(1, -1))), 1)


def initial_placement(num_layers: int, num_logical: int, num_ranks: int, num_redundant: int) -> Placement:
    """Where the experts start: contiguous without replicas; with `num_redundant` extra slots, the expert LB's plan
    for an even load (the replicas go to the first experts until the ranks' own load says better, at the first
    rebalance). A count that cannot be split evenly over the ranks is refused, naming the numbers."""
    if not num_redundant:
        return Placement.contiguous(num_layers, num_logical, num_ranks)
    if (num_logical + num_redundant) % num_ranks:
        raise ValueError(f"redundant_experts {num_redundant}: {num_logical} experts + {num_redundant} replicas do not "
                         f"split evenly over {num_ranks} ranks; choose a count that makes the sum a multiple of "
                         f"{num_ranks}")
    return rebalance_experts(torch.ones(num_layers, num_logical), num_ranks, num_redundant)
