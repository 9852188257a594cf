"""bf16 projections packed for oneDNN at load: the same products, tied weights and other dtypes left plain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.default_model import DEFAULT_CONFIG, write_default_model
from engine.model import load_model
from engine.model.packed_linear import PackedLinear, pack_linears, packing_available
from engine.model.paged import AttentionMetadata, allocate_kv_cache

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN linear packing")

SMALL = DEFAULT_CONFIG.model_copy(update=dict(num_layers=2, hidden_size=128, intermediate_size=192,
                                              moe_intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=32,
                                              vocab_size=512))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    kv = allocate_kv_cache(model.config, num_blocks=-(-len(ids) // 16), block_size=16)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(len(kv[0][0])))], 16)
    return model.logits(model(ids, torch.arange(len(ids)), kv, meta)).float()


def count(model, kind) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


def test_a_bf16_model_is_loaded_with_every_projection_packed_and_the_same_logits(tmp_path, monkeypatch):
    model_dir = write_default_model(tmp_path / "model", SMALL, seed=5)
    ids = torch.randint(0, 512, (21,), generator=torch.Generator().manual_seed(1))
    packed = load_model(model_dir, "bfloat16")
    # per layer q, k, v, o and the router's gate; then the lm_head
    assert count(packed, PackedLinear) == 2 * 5 + 1 and count(packed, nn.Linear) == 0
    monkeypatch.setattr("engine.model.loader.pack_linears", lambda model: 0)
    plain = load_model(model_dir, "bfloat16")
    got, want = logits(packed, ids), logits(plain, ids)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert count(load_model(model_dir, "float32"), PackedLinear) == 0  # fp32 runs torch's own GEMM


def test_a_weight_tied_to_the_embedding_and_a_layer_that_disagrees_stay_plain(monkeypatch):
    model = nn.Module()
    model.embed = nn.Embedding(64, 32, dtype=torch.bfloat16)
    model.head = nn.Linear(32, 64, bias=False, dtype=torch.bfloat16)
    model.head.weight = model.embed.weight
    model.proj = nn.Linear(32, 32, dtype=torch.bfloat16)
    model.other = nn.Linear(32, 32, dtype=torch.bfloat16)
    forward = PackedLinear.forward

    def off_for_proj(self, x):  # a packing that computes something else for one layer only
        out = forward(self, x)
        return out + 1 if self.bias is model.proj.bias else out

    monkeypatch.setattr(PackedLinear, "forward", off_for_proj)
    assert pack_linears(model) == 1
    assert isinstance(model.head, nn.Linear) and isinstance(model.proj, nn.Linear)
    assert isinstance(model.other, PackedLinear)
