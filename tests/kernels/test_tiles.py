"""The tiled layout of expert weights: each bf16 16x32 tile contiguous, each fp32 column of a 16-row block one
vector, each expert's slot its own bytes."""

from __future__ import annotations

import pytest
import torch

from engine.offline.default_model import write_default_model
from engine.model.loader import load_model
from tests.engine.model.conftest import TILE_SHAPED_CONFIG, full_forward_logits
from tests.kernels.conftest import cpu_has_amx, cpu_has_avx512
from tideflow_kernels import cases, ops, reference
from tideflow_kernels.tiles import from_tiles, to_tiles

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_every_bf16_tile_is_one_contiguous_block_in_row_then_column_order():
    bits = torch.arange(2 * 32 * 64, dtype=torch.int16).reshape(2, 32, 64)  # distinct bf16 bit patterns
    tiled = to_tiles(bits.view(torch.bfloat16)).view(torch.int16)
    assert tiled.shape == bits.shape
    flat = tiled[1].reshape(-1)
    # expert 1, row block 1 (rows 16-31), column block 1 (columns 32-63): the 4th tile of the expert
    assert torch.equal(flat[3 * 512 : 4 * 512], bits[1, 16:32, 32:64].reshape(-1))
    assert torch.equal(tiled[0], to_tiles(bits[:1].view(torch.bfloat16)).view(torch.int16)[0])  # its own rows only
    assert torch.equal(from_tiles(tiled.view(torch.bfloat16)).view(torch.int16), bits)


def test_an_fp32_block_of_16_rows_holds_each_column_as_one_vector():
    w = torch.arange(2 * 32 * 24, dtype=torch.float32).reshape(2, 32, 24)
    flat = to_tiles(w)[1].reshape(-1)
    # expert 1, row block 1 (rows 16-31), column 5: 16 consecutive values, the block's 6th vector
    assert torch.equal(flat[32 * 24 // 2 + 5 * 16 : 32 * 24 // 2 + 6 * 16], w[1, 16:32, 5])
    assert torch.equal(from_tiles(to_tiles(w)), w)


def test_shapes_that_do_not_tile_are_refused():
    with pytest.raises(ValueError, match="R % 16 == 0 and K % 32 == 0"):
        to_tiles(torch.zeros(1, 32, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="R % 16 == 0 and K % 1 == 0"):
        to_tiles(torch.zeros(1, 24, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_reads_tiled_weights(dtype):
    x, w13, w2, weights, ids = cases.moe_args(9, 64, 32, 4, 2, dtype, "cpu")
    want = reference.moe_experts(x, w13, w2, weights, ids)
    assert torch.equal(reference.moe_experts(x, to_tiles(w13), to_tiles(w2), weights, ids, tiled=True), want)
    assert not torch.equal(reference.moe_experts(x, to_tiles(w13), to_tiles(w2), weights, ids), want)


@pytest.mark.parametrize("dtype,tolerance", [("bfloat16", 0.05), ("float32", 1e-5)])
def test_a_model_loaded_under_the_cpu_build_keeps_its_experts_tiled_and_computes_the_same(
        cpu_build, tmp_path, dtype, tolerance):
    """load_model tiles the experts when the routed kernel reads them fastest that way (bf16 on an AMX host,
    fp32 with AVX-512); the logits then match the row-major model's, and switching back to the reference ops
    still computes the same experts from the tiled weights."""
    model_dir = write_default_model(tmp_path / "model", TILE_SHAPED_CONFIG, seed=3)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    plain = load_model(model_dir, dtype)  # reference ops routed (the conftest's default)
    assert not plain.moe_layers()[0].experts.tiled
    want = full_forward_logits(plain, ids)
    ops.use_compiled("moe_experts", cpu_build[1]["moe_experts"])
    model = load_model(model_dir, dtype)
    fits = cpu_has_amx() if dtype == "bfloat16" else cpu_has_avx512()
    assert [m.experts.tiled for m in model.moe_layers()] == [fits] * 2
    got = full_forward_logits(model, ids)
    assert (got - want).abs().max() <= tolerance * want.abs().max()
    ops.use_reference()
    assert torch.equal(full_forward_logits(model, ids), want)
