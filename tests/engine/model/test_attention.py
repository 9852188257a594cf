"""Prefill attention runs on torch's fused CPU attention (flash), not its unfused math path: 3-d inputs
silently fall back to math, 11x slower for a 128-token bf16 prompt on two cores. Both prefill cases are
covered: a whole prompt (causal) and a chunk after cached tokens (masked); the results equal the math
path's."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from engine.model.loader import load_model
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


def test_a_mixed_step_gives_each_sequence_what_it_gets_alone_and_decodes_take_the_paged_kernel(tiny_model_dir):
    """Two decodes (first, as the scheduler orders a step), a chunk after a cached prefix and a whole prompt in
    one step: each row's logits equal those of its sequence run alone, and only the two prefill rows go through
    the fused prefill attention (the decodes through the paged decode kernel, not a gather of their context)."""
    model = load_model(tiny_model_dir)
    block, layers = 16, model.config.num_layers
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (30, 45, 40, 12)]
    cached = [29, 44, 24, 0]  # tokens each sequence holds before the step: two decodes, a chunk, a new prompt
    alone = [prefill(model, ids, c)[-1] for ids, c in zip(prompts, cached)]

    kv = allocate_kv_cache(model.config, num_blocks=16, block_size=block)
    tables = [[4 * i, 4 * i + 1, 4 * i + 2] for i in range(len(prompts))]
    with torch.no_grad():
        for ids, c, table in zip(prompts, cached, tables):
            if c:
                model(ids[:c], torch.arange(c), kv, AttentionMetadata.build([c], [c], [table], block))
        ids = torch.cat([p[c:] for p, c in zip(prompts, cached)])
        pos = torch.cat([torch.arange(c, len(p)) for p, c in zip(prompts, cached)])
        meta = AttentionMetadata.build([len(p) - c for p, c in zip(prompts, cached)], [len(p) for p in prompts],
                                       tables, block)
        assert meta.num_decodes == 2
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            hidden = model(ids, pos, kv, meta)
        last = torch.tensor(list(itertools.accumulate(len(p) - c for p, c in zip(prompts, cached)))) - 1
        mixed = model.logits(hidden.index_select(0, last))
    fused_calls = sum(e.count for e in prof.key_averages() if e.key == FUSED)
    assert fused_calls == 2 * layers, fused_calls
    for row, want in enumerate(alone):
        assert torch.allclose(mixed[row], want, atol=1e-4, rtol=1e-4), row
