"""The MoE experts on torch's grouped GEMM: the token copies' order and group bounds, agreement with the reference
on every check case it takes (fp32 and bf16, skipped experts and tiled weights included), the calls it leaves to
the compiled kernel, and the build keeping whichever of the two it measured faster."""

from __future__ import annotations

import pytest
import torch

from tideflow_kernels import cases, grouped_moe, reference
from tideflow_kernels.build import _grouped_or_compiled
from tideflow_kernels.spec import BuildRequest, BuildResult

pytestmark = pytest.mark.skipif(not grouped_moe.available(), reason="this torch has no torch._grouped_mm")


def test_copies_are_sorted_by_expert_with_skipped_ones_last():
    ids = torch.tensor([[2, 0], [-1, 2], [1, -1], [0, 2]])
    order, ends, kept = sorted_by = grouped_moe.sorted_by_expert(ids, 3)
    flat = ids.reshape(-1)
    assert flat[order].tolist() == [0, 0, 1, 2, 2, 2, -1, -1]
    assert order.tolist() == [1, 6, 4, 0, 3, 7, 2, 5]  # stable: copies of one expert keep the tokens' order
    assert ends.dtype == torch.int32 and ends.tolist() == [2, 3, 6]
    assert kept.tolist() == [True] * 6 + [False] * 2
    assert len(sorted_by) == 3


@pytest.mark.parametrize("dtype", cases.CHECK_DTYPES, ids=str)
def test_every_check_case_it_takes_matches_the_reference(dtype):
    taken = 0
    for args in cases.check_cases("moe_experts", dtype, "cpu"):
        x, w13, w2 = args[:3]
        tiled = len(args) > 5 and args[5]
        if tiled or not grouped_moe.fits(x, w13, w2):
            continue
        got = grouped_moe.moe_experts(*args)
        error = cases.relative_error("moe_experts", got, reference.moe_experts(*args), args)
        assert error <= cases.tolerance("moe_experts", dtype), (x.shape, w2.shape, error)
        taken += 1
    assert taken >= 3


def test_a_wrong_expert_is_caught_by_the_same_check():
    args = cases.check_cases("moe_experts", torch.float32, "cpu")[2]
    x, w13, w2, weights, ids = args[:5]
    swapped = w13.flip(0)  # every copy computed by another expert's weights
    got = grouped_moe.moe_experts(x, swapped, w2, weights, ids)
    assert cases.relative_error("moe_experts", got, reference.moe_experts(*args), args) > 0.1


def test_calls_the_grouped_gemm_cannot_take_go_to_the_fallback():
    seen = []

    def fallback(*args):
        seen.append(args[0].shape)
        return reference.moe_experts(*args)

    fn = grouped_moe.make(fallback)
    for args in cases.check_cases("moe_experts", torch.float32, "cpu"):
        fn(*args)
    unaligned = [a[0].shape for a in cases.check_cases("moe_experts", torch.float32, "cpu")
                 if not grouped_moe.fits(*a[:3]) or (len(a) > 5 and a[5])]
    assert seen == unaligned and seen


def test_the_build_keeps_the_faster_of_the_two_that_verify():
    request = BuildRequest(bench_iters=2, bench_hidden=512)
    slow = BuildResult(op="moe_experts", status="verified", compiled_us=1e9, reference_us=1.0)
    result, fn = _grouped_or_compiled(slow, reference.moe_experts, "cpu", request, lambda _: None)
    assert result.variant == "grouped_mm" and result.status == "verified" and result.compiled_us < 1e9
    assert "torch._grouped_mm" in result.message and fn is not reference.moe_experts
    fast = BuildResult(op="moe_experts", status="verified", compiled_us=1e-9, reference_us=1.0)
    result, fn = _grouped_or_compiled(fast, reference.moe_experts, "cpu", request, lambda _: None)
    assert result is fast and fn is reference.moe_experts
