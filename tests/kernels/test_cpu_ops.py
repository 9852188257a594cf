"""Every compiled CPU op against its torch reference, fp32 and bf16, odd and tiny shapes."""

from __future__ import annotations

import pytest
import torch

from tideflow_kernels import cases, reference
from tideflow_kernels.errors import KernelInputError
from tideflow_kernels.tiles import to_tiles
from tests.kernels.conftest import cpu_has_amx, cpu_has_avx512

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

DTYPES = [torch.float32, torch.bfloat16]
ids = lambda dt: str(dt).removeprefix("torch.")  # noqa: E731


def assert_close(op, impl, args):
    got, want = impl(*args), getattr(reference, op)(*args)
    dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
    err = cases.relative_error(op, got, want, args)
    assert err <= cases.tolerance(op, dtype), f"{op} {dtype}: relative error {err:.3g}"
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("tokens,hidden,residual", [(1, 4099, True), (13, 4099, False), (13, 512, True), (2, 7, True)])
def test_rms_norm(cpu_build, dtype, tokens, hidden, residual):
    args = cases.rms_norm_args(tokens, hidden, dtype, "cpu", residual=residual)
    normed, new_residual = assert_close("rms_norm", cpu_build[1]["rms_norm"], args)
    x, _, _, r = args
    expected = x + r if residual else x
    assert torch.equal(new_residual, expected)


def test_rms_norm_fp32_weight_with_bf16_input(cpu_build):
    x, w, eps, r = cases.rms_norm_args(5, 300, torch.bfloat16, "cpu")
    assert_close("rms_norm", cpu_build[1]["rms_norm"], (x, w.float(), eps, r))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("tokens,hq,hk,dim,strided", [(1, 4, 4, 64, False), (13, 8, 2, 128, True), (3, 3, 1, 18, False)])
def test_rotary_embedding(cpu_build, dtype, tokens, hq, hk, dim, strided):
    args = cases.rotary_args(tokens, hq, hk, dim, dtype, "cpu", max_pos=257, strided=strided)
    assert_close("rotary_embedding", cpu_build[1]["rotary_embedding"], args)


def test_rotary_rejects_position_outside_table(cpu_build):
    q, k, pos, cs = cases.rotary_args(2, 2, 2, 8, torch.float32, "cpu", max_pos=16)
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu_build[1]["rotary_embedding"](q, k, torch.tensor([3, 16]), cs)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("tokens,experts,k,renorm", [(1, 8, 2, True), (13, 64, 8, True), (13, 60, 6, False), (4, 5, 5, True)])
def test_topk_gating(cpu_build, dtype, tokens, experts, k, renorm):
    args = cases.gating_args(tokens, experts, k, dtype, "cpu", renormalize=renorm)
    weights, chosen = assert_close("topk_gating", cpu_build[1]["topk_gating"], args)
    assert weights.dtype == torch.float32 and chosen.dtype == torch.int64
    if renorm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,k,skip",
    [(1, 256, 64, 8, 2, 0.0), (13, 257, 96, 8, 2, 0.3), (37, 128, 64, 4, 2, 0.1), (5, 64, 32, 4, 1, 1.0)],
)
def test_moe_experts(cpu_build, dtype, tokens, hidden, inter, experts, k, skip):
    # 37 tokens over 4 experts takes the at::mm path (groups > 8); the others the fused loop.
    args = cases.moe_args(tokens, hidden, inter, experts, k, dtype, "cpu", skip_fraction=skip)
    out = assert_close("moe_experts", cpu_build[1]["moe_experts"], args)
    if skip == 1.0:  # every expert on another rank: nothing to add
        assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("tokens,experts", [(1, 8), (2, 4), (20, 8), (75, 4)])
def test_moe_experts_on_tiled_weights(cpu_build, dtype, tokens, experts):
    """Tiled weights give the experts of the same weights row-major: on tiles (bf16 on an AMX host, fp32 with
    AVX-512; single tokens included, and fp32 groups of several register tiles) and through a row-major copy
    where the tiles cannot run them."""
    x, w13, w2, weights, chosen = cases.moe_args(tokens, 128, 96, experts, 2, dtype, "cpu")
    fn = cpu_build[1]["moe_experts"]
    tiled = fn(x, to_tiles(w13), to_tiles(w2), weights, chosen, True)
    err = cases.relative_error("moe_experts", tiled, reference.moe_experts(x, w13, w2, weights, chosen))
    assert err <= cases.tolerance("moe_experts", dtype), f"relative error {err:.3g}"
    with pytest.raises(RuntimeError, match="multiples of 16" if dtype == torch.float32 else "multiples of 32"):
        fn(x[:, :100], w13[:, :, :100], w2[:, :100], weights, chosen, True)


def test_fp32_tiled_weights_with_an_odd_count_of_16_row_blocks(cpu_build):
    """hidden 144 = 9 blocks of 16: the last 16 output columns go through a single block of W2."""
    x, w13, w2, weights, chosen = cases.moe_args(29, 144, 48, 4, 2, torch.float32, "cpu")
    tiled = cpu_build[1]["moe_experts"](x, to_tiles(w13), to_tiles(w2), weights, chosen, True)
    err = cases.relative_error("moe_experts", tiled, reference.moe_experts(x, w13, w2, weights, chosen))
    assert err <= cases.tolerance("moe_experts", torch.float32), f"relative error {err:.3g}"


def test_tiles_fit_bf16_on_amx_and_fp32_on_avx512_in_tile_shapes(cpu_build):
    fits = cpu_build[1]["moe_experts"].tiles_fit
    w13, w2 = torch.zeros(2, 192, 128, dtype=torch.bfloat16), torch.zeros(2, 128, 96, dtype=torch.bfloat16)
    assert fits(w13, w2) == cpu_has_amx()
    assert not fits(torch.zeros(2, 192, 96, dtype=torch.bfloat16), torch.zeros(2, 96, 96, dtype=torch.bfloat16))
    assert fits(w13.float(), w2.float()) == cpu_has_avx512()
    assert not fits(torch.zeros(2, 192, 100), torch.zeros(2, 100, 96))  # hidden 100: not whole blocks of 16
    assert not fits(w13.half(), w2.half())


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize(
    "lens,hq,hk,dim,block",
    [([1], 4, 4, 64, 16), ([1, 37, 100], 8, 2, 128, 16), ([13, 5], 6, 3, 80, 8), ([33] * 4, 32, 8, 128, 32)],
)
def test_paged_decode_attention(cpu_build, dtype, lens, hq, hk, dim, block):
    args = cases.attention_args(lens, hq, hk, dim, dtype, "cpu", block_size=block)
    assert_close("paged_decode_attention", cpu_build[1]["paged_decode_attention"], args)


def test_unsupported_dtype_is_rejected(cpu_build):
    x, w, eps, r = cases.rms_norm_args(2, 8, torch.float64, "cpu")
    with pytest.raises(KernelInputError, match="x is torch.float64; the compiled ops take float32 or bfloat16"):
        cpu_build[1]["rms_norm"](x, w, eps, r)
