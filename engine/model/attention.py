"""Grouped-query attention that writes to and reads from the paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig
from engine.model.norm import RMSNorm
from engine.model.paged import AttentionMetadata
from tideflow_kernels import ops

# torch >= 2.5 takes grouped-query inputs as they are (enable_gqa). Used on the CPU, where it was measured
# (a 128-token chunk over 1,628 cached tokens: 2.7 ms against 4.0 ms with the heads repeated, fp32, 2 cores);
# CUDA keeps the repeated heads its fused kernels were measured with until a GPU run says otherwise
SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        h, dt, bias = config.hidden_size, config.torch_dtype, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias, dtype=dt)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias, dtype=dt)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias, dtype=dt)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False, dtype=dt)
        self.q_norm = RMSNorm(self.head_dim, config.rms_eps, dt) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_eps, dt) if config.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        q, k = ops.rotary_embedding(q, k, positions, cos_sin)
        k_cache, v_cache = kv
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)
        # A step mixes decodes (one token each, first in the batch) with prefill chunks: the decodes take the
        # paged kernel whatever else is in the step. Through the prefill path each would gather its whole
        # context per layer: 12 decodes at 3,000 tokens beside a 128-token chunk took 249 ms, not 125 (2 cores)
        d = meta.num_decodes
        parts = []
        if d:
            parts.append(ops.paged_decode_attention(q[:d], k_cache, v_cache, meta.block_tables[:d],
                                                    meta.context_lens[:d], self.scale))
        if d < T:
            parts.append(self._prefill(q[d:], k_cache, v_cache, meta))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Per-sequence causal attention over cached prefix + new tokens (chunked prefill safe), for the
        sequences after the leading decodes (`q` holds their tokens only)."""
        block_size = k_cache.shape[1]
        group = self.num_heads // self.num_kv_heads
        outs, start = [], 0
        for i in range(meta.num_decodes, len(meta.query_lens)):
            n, ctx = meta.query_lens[i], meta.host_context_lens[i]
            blocks = meta.block_tables[i, : (ctx + block_size - 1) // block_size].long()
            keys = k_cache[blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:ctx]
            vals = v_cache[blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:ctx]
            # [1, heads, tokens, dim]: torch's fused CPU attention (flash) takes only 4-d inputs; 3-d ones
            # fall back to the unfused math path, 11x slower for a 128-token bf16 prompt on 2 cores
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)
            ki, vi = keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)
            gqa = {}
            if group > 1 and q.device.type == "cpu" and SDPA_GQA:
                gqa = {"enable_gqa": True}  # the fused CPU kernel reads each KV head for its group: no copies
            elif group > 1:
                ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)
            if n == ctx:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale, **gqa)
            else:
                # query t sits at absolute position ctx - n + t and sees keys up to that position
                qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
                mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale, **gqa)
            outs.append(o[0].transpose(0, 1))
            start += n
        return torch.cat(outs, dim=0)
