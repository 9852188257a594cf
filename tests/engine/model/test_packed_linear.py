"""bf16 projections packed for oneDNN at load: the same products, tied weights and other dtypes left plain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.default_model import write_default_model
from engine.model import load_model
from engine.model.packed_linear import PackedLinear, pack_linears, packing_available
from tests.engine.model.conftest import TILE_SHAPED_CONFIG, full_forward_logits

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN linear packing")

def count(model, kind) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


def test_a_bf16_model_is_loaded_with_every_projection_packed_and_the_same_logits(tmp_path, monkeypatch):
    model_dir = write_default_model(tmp_path / "model", TILE_SHAPED_CONFIG, seed=5)
    ids = torch.randint(0, 512, (21,), generator=torch.Generator().manual_seed(1))
    packed = load_model(model_dir, "bfloat16")
    # per layer q, k, v, o and the router's gate; then the lm_head
    assert count(packed, PackedLinear) == 2 * 5 + 1 and count(packed, nn.Linear) == 0
    monkeypatch.setattr("engine.model.loader.pack_linears", lambda model: 0)
    plain = load_model(model_dir, "bfloat16")
    got, want = full_forward_logits(packed, ids), full_forward_logits(plain, ids)
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
