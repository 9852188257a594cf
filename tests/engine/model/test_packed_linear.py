"""CPU projections packed for oneDNN at load where measured faster: the same products; tied weights, layers that
disagree and layers measured slower left plain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.offline.default_model import write_default_model
from engine.model.loader import load_model
from engine.model import packed_linear
from engine.model.packed_linear import PackedLinear, pack_linears, packing_available, weight_bytes
from tests.engine.model.conftest import TILE_SHAPED_CONFIG, full_forward_logits

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN linear packing")


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    try:
        PackedLinear(nn.Linear(8, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


def count(model, kind) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


@pytest.mark.parametrize("dtype,tolerance", [("bfloat16", 0.05), ("float32", 1e-4)])
def test_a_model_measured_faster_packed_has_every_projection_packed_and_the_same_logits(tmp_path, monkeypatch, dtype,
                                                                                         tolerance):
    if not packs(getattr(torch, dtype)):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU (they stay plain, with a warning)")
    model_dir = write_default_model(tmp_path / "model", TILE_SHAPED_CONFIG, seed=5)
    ids = torch.randint(0, 512, (21,), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(packed_linear, "packing_pays", lambda linear, packed: True)
    packed = load_model(model_dir, dtype)
    # per layer q, k, v, o and the router's gate; then the lm_head
    assert count(packed, PackedLinear) == 2 * 5 + 1 and count(packed, nn.Linear) == 0
    monkeypatch.setattr(packed_linear, "packing_pays", lambda linear, packed: False)
    plain = load_model(model_dir, dtype)
    assert count(plain, PackedLinear) == 0
    got, want = full_forward_logits(packed, ids), full_forward_logits(plain, ids)
    assert (got - want).abs().max() <= tolerance * want.abs().max()


def test_the_weights_in_memory_count_the_packed_projections(tmp_path, monkeypatch):
    """What `tideflow profile` reports as weights (capacity plans add it up): packed or not, every byte is counted.
    A packed projection's weight is no parameter, so counting parameters alone lost the packed ones, and with them
    a figure that depends on which layers the load measured faster packed."""
    if not packs(torch.float32):
        pytest.skip("oneDNN packs no float32 weights on this CPU")
    model_dir = write_default_model(tmp_path / "model", TILE_SHAPED_CONFIG, seed=5)
    monkeypatch.setattr(packed_linear, "packing_pays", lambda linear, packed: False)
    plain = load_model(model_dir, "float32")
    monkeypatch.setattr(packed_linear, "packing_pays", lambda linear, packed: True)
    packed = load_model(model_dir, "float32")
    assert weight_bytes(plain) == sum(p.numel() * p.element_size() for p in plain.parameters())
    assert sum(p.numel() * p.element_size() for p in packed.parameters()) < weight_bytes(plain)  # the lost bytes
    assert weight_bytes(plain) <= weight_bytes(packed) <= 1.1 * weight_bytes(plain)  # oneDNN's blocks may pad


def test_the_measurement_keeps_the_faster_side_and_times_each_shape_once(monkeypatch):
    model = nn.Module()
    model.a, model.b = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=False)  # one shape
    model.c = nn.Linear(64, 32, bias=False)
    timed = []

    def compare(ours, theirs, args, iters, warmup=3):  # packed measured slower for (64, 32) only
        timed.append(tuple(theirs.weight.shape))
        return (2.0, 1.0) if theirs.weight.shape == (64, 32) else (1.0, 2.0)

    monkeypatch.setattr(packed_linear, "compare_us", compare)
    assert pack_linears(model) == 1
    assert isinstance(model.a, nn.Linear) and isinstance(model.b, nn.Linear) and isinstance(model.c, PackedLinear)
    assert sorted(set(timed)) == [(32, 64), (64, 32)] and len(timed) == 2 * len(packed_linear.TIMED_ROWS)


def test_a_weight_tied_to_the_embedding_and_a_layer_that_disagrees_stay_plain(monkeypatch):
    model = nn.Module()
    model.embed = nn.Embedding(64, 32)  # fp32: oneDNN packs it on every CPU it runs on (bf16 needs AVX-512)
    model.head = nn.Linear(32, 64, bias=False)
    model.head.weight = model.embed.weight
    model.proj = nn.Linear(32, 32)
    model.other = nn.Linear(32, 32)
    forward = PackedLinear.forward

    def off_for_proj(self, x):  # a packing that computes something else for one layer only
        out = forward(self, x)
        return out + 1 if self.bias is model.proj.bias else out

    monkeypatch.setattr(PackedLinear, "forward", off_for_proj)
    monkeypatch.setattr(packed_linear, "packing_pays", lambda linear, packed: True)
    assert pack_linears(model) == 1
    assert isinstance(model.head, nn.Linear) and isinstance(model.proj, nn.Linear)
    assert isinstance(model.other, PackedLinear)
