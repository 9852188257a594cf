"""Sparse MoE block: softmax top-k router, SwiGLU experts (shardable), optional shared expert."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig
from tideflow_kernels import ops
from tideflow_kernels.tiles import to_tiles

# (x, topk_weights, topk_ids, compute_local) -> combined expert output. The default runs every
# expert locally; expert parallelism installs one that dispatches tokens to the ranks holding them.
ExpertDispatcher = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]], torch.Tensor]


class DenseMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False, dtype=dtype)
        self.down = nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self.inter = inter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up(x)
        return self.down(F.silu(h[:, : self.inter]) * h[:, self.inter :])


class Experts(nn.Module):
    """The routed experts this rank holds, as stacked weights for a grouped GEMM.

    `local_of[logical]` is the slot of a logical expert in w13/w2, or -1 when another rank
    holds it; one process holding all experts has local_of == arange(E). `tiled`: w13 and w2 are in
    the tiled layout of tideflow_kernels.tiles (use_tiles), each expert's slot still its own bytes.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, local: list[int] | None = None) -> None:
        super().__init__()
        local = list(range(num_experts)) if local is None else local
        self.w13 = nn.Parameter(torch.empty(len(local), 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(len(local), hidden, inter, dtype=dtype), requires_grad=False)
        local_of = torch.full((num_experts,), -1, dtype=torch.int64)
        local_of[torch.tensor(local, dtype=torch.int64)] = torch.arange(len(local))
        self.register_buffer("local_of", local_of, persistent=False)
        self.local_experts = list(local)
        self.tiled = False

    def use_tiles(self) -> bool:
        """Keep the weights in the tiled layout when the routed kernel reads them fastest that way (a CPU build
        with AMX tiles for bf16, with AVX-512 for fp32); True when they are tiled. The ops read either layout, so a later switch of
        kernels (back to the reference, say) still computes the same experts."""
        if not self.tiled and ops.expert_tiles_fit(self.w13, self.w2):
            self.w13 = nn.Parameter(to_tiles(self.w13.data), requires_grad=False)
            self.w2 = nn.Parameter(to_tiles(self.w2.data), requires_grad=False)
            self.tiled = True
        return self.tiled

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.run(x, topk_weights, self.local_of[topk_ids])

    def run(self, x: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """The experts at their local slots (-1: skipped, another rank holds it)."""
        return ops.moe_experts(x, self.w13, self.w2, topk_weights, local_ids, self.tiled)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dt, h = config.torch_dtype, config.hidden_size
        self.top_k, self.renormalize = config.experts_per_token, config.norm_topk_prob
        self.gate = nn.Linear(h, config.num_experts, bias=False, dtype=dt)
        self.experts = Experts(config.num_experts, h, config.moe_intermediate_size, dt)
        self.shared = DenseMLP(h, config.shared_expert_intermediate_size, dt) if config.num_shared_experts else None
        self.shared_gate = nn.Linear(h, 1, bias=False, dtype=dt) if config.num_shared_experts else None
        self.dispatcher: ExpertDispatcher | None = None
        self.load_observer: Callable[[torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.topk_gating(self.gate(x), self.top_k, self.renormalize)
        if self.load_observer is not None:
            self.load_observer(ids)
        weights = weights.to(x.dtype)
        if self.dispatcher is None:
            out = self.experts(x, weights, ids)
        else:
            out = self.dispatcher(x, weights, ids, self.experts)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out
