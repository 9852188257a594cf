"""Plain-torch reference implementations of every custom op.

These define the semantics that compiled kernels must match, and they are what the
engine runs when no compiled build is present.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tideflow_kernels.tiles import from_tiles


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm fused with the residual add: returns (norm(x + residual) * weight, x + residual).

    Without a residual the second value is `x` itself. Statistics are computed in fp32.
    """
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype), x


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (GPT-NeoX / HF Llama) rotary embedding.

    q: [T, Hq, D], k: [T, Hk, D], positions: [T] int64, cos_sin: [max_pos, D] fp32 holding
    cos in the first D/2 columns and sin in the last D/2. Returns new (q, k).
    """
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions)
    cos = cs[:, :half].unsqueeze(1)
    sin = cs[:, half:].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def topk_gating(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (fp32), top-k, optional renormalisation of the k weights.

    Returns (weights [T, k] fp32, expert ids [T, k] int64).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiled: bool = False,
) -> torch.Tensor:
    """SwiGLU experts as a grouped GEMM over tokens sorted by expert.

    x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I];
    topk_weights: [T, k]; topk_ids: [T, k] indexing w13's first dim. Ids < 0 are skipped
    (their expert lives on another rank). `tiled`: the weights are in the tiled layout
    (tideflow_kernels.tiles). Returns sum_k weight * expert(x) as [T, H].
    """
    if tiled:
        w13, w2 = from_tiles(w13), from_tiles(w2)
    T, H = x.shape
    k = topk_ids.shape[1]
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    token_of = order // k
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    counts = torch.bincount(sorted_ids.clamp(min=0), minlength=w13.shape[0]).tolist()
    valid_start = int((sorted_ids < 0).sum())
    if valid_start:
        counts[0] -= valid_start
    start = valid_start
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = order[start : start + n]
        toks = token_of[start : start + n]
        start += n
        h = x.index_select(0, toks) @ w13[e].t()
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = (act @ w2[e].t()).float()
        w = topk_weights.reshape(-1).index_select(0, idx).unsqueeze(1)
        out.index_add_(0, toks, y * w)
    return out.to(x.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending over its KV blocks.

    q: [B, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hk, D];
    block_tables: [B, max_blocks] int (entries past a sequence's length are ignored);
    context_lens: [B] int. Grouped-query: Hq is a multiple of Hk. Returns [B, Hq, D].
    """
    B, Hq, D = q.shape
    block_size, Hk = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hk
    max_len = int(context_lens.max())
    n_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :n_blocks].long().clamp(min=0)
    k = k_cache[tables].reshape(B, n_blocks * block_size, Hk, D)[:, :max_len]
    v = v_cache[tables].reshape(B, n_blocks * block_size, Hk, D)[:, :max_len]
    k = k.repeat_interleave(group, dim=2).float()
    v = v.repeat_interleave(group, dim=2).float()
    scores = torch.einsum("bhd,bthd->bht", q.float(), k) * scale
    pos = torch.arange(max_len, device=q.device)
    mask = pos.unsqueeze(0) >= context_lens.to(q.device).unsqueeze(1)
    scores = scores.masked_fill(mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bht,bthd->bhd", probs, v).to(q.dtype)
