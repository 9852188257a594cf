"""Prefill attention runs on torch's fused CPU attention (flash), not its unfused math path: 3-d inputs
silently fall back to math, 11x slower for a 128-token bf16 prompt on two cores. Both prefill cases are
covered: a whole prompt (causal) and a chunk after cached tokens (masked); the results equal the math
path's."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from engine.model import load_model
from engine.model.paged import AttentionMetadata, allocate_kv_cache

FUSED, MATH = "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"


def prefill(model, ids: torch.Tensor, cached: int) -> torch.Tensor:
    """Logits of ids[cached:] after ids[:cached] were computed in an earlier step (0: one whole prompt)."""
    block = 16
    kv = allocate_kv_cache(model.config, num_blocks=-(-len(ids) // block), block_size=block)
    table = [list(range(len(kv[0][0])))]
    with torch.no_grad():
        if cached:
            model(ids[:cached], torch.arange(cached), kv, AttentionMetadata.build([cached], [cached], table, block))
        rest = ids[cached:]
        meta = AttentionMetadata.build([len(rest)], [len(ids)], table, block)
        return model.logits(model(rest, torch.arange(cached, len(ids)), kv, meta))


@pytest.mark.parametrize("cached", [0, 24], ids=["whole-prompt", "after-cached-prefix"])
def test_prefill_attention_is_fused_and_equals_the_math_path(tiny_model_dir, cached):
    model = load_model(tiny_model_dir)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(cached))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fused = prefill(model, ids, cached)
    ran = {e.key for e in prof.key_averages()}
    assert FUSED in ran and MATH not in ran, sorted(k for k in ran if "dot_product" in k)
    with sdpa_kernel(SDPBackend.MATH):
        math = prefill(model, ids, cached)
    assert torch.allclose(fused, math, atol=1e-4, rtol=1e-4)
