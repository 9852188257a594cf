"""What the model tests share: the logits of every position of one prompt, and a small config whose expert
shapes the AMX tiles take."""

from __future__ import annotations

import torch

from engine.offline.default_model import DEFAULT_CONFIG
from engine.model.paged import AttentionMetadata, allocate_kv_cache

TILE_SHAPED_CONFIG = DEFAULT_CONFIG.model_copy(update=dict(
    num_layers=2, hidden_size=128, intermediate_size=192, moe_intermediate_size=96, num_heads=4, num_kv_heads=2,
    head_dim=32, vocab_size=512))


def full_forward_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of one prompt run whole through a fresh paged KV cache."""
    block = 16
    kv = allocate_kv_cache(model.config, num_blocks=-(-len(ids) // block), block_size=block)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(len(kv[0][0])))], block)
    return model.logits(model(ids, torch.arange(len(ids)), kv, meta))
