"""Each call goes to the compiled build of its tensors' device, and a compiled op handed tensors of another
device (or an unsupported dtype) raises a clear error instead of reading the wrong memory (issue #23)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tideflow_kernels import ops, reference
from tideflow_kernels.errors import KernelInputError

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_a_cpu_build_refuses_tensors_of_another_device(cpu_build):
    _, impls = cpu_build
    x, w = torch.empty(4, 64, device="meta"), torch.empty(64, device="meta")
    with pytest.raises(KernelInputError, match=r"rms_norm: the compiled cpu build was handed x on meta"):
        impls["rms_norm"](x, w, 1e-6)
    q = torch.randn(2, 4, 16)
    cache = torch.empty(8, 16, 2, 16, device="meta")
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(KernelInputError, match=r"paged_decode_attention: .* handed k_cache on meta"):
        impls["paged_decode_attention"](q, cache, cache, tables, lens, 0.25)
    with pytest.raises(KernelInputError, match=r"moe_experts: .* handed topk_ids on meta"):
        impls["moe_experts"](torch.randn(2, 8), torch.randn(4, 32, 8), torch.randn(4, 8, 16), torch.rand(2, 2),
                             torch.zeros(2, 2, dtype=torch.int64, device="meta"))


def test_a_cpu_build_refuses_a_dtype_it_has_no_code_for(cpu_build):
    _, impls = cpu_build
    with pytest.raises(KernelInputError, match=r"rms_norm: x is torch.float16"):
        impls["rms_norm"](torch.randn(4, 64, dtype=torch.float16), torch.randn(64), 1e-6)


def test_each_device_type_is_routed_to_its_own_build(cpu_build):
    """The CPU build and a CUDA build are loaded side by side; a CPU tensor never reaches the CUDA one and a
    tensor of neither device gets the torch reference."""
    _, impls = cpu_build
    cuda_calls = []

    def cuda_build(logits, k, renormalize):
        cuda_calls.append(logits)
        return "computed by the cuda build"

    ops.use_compiled("topk_gating", impls["topk_gating"], "cpu")
    ops.use_compiled("topk_gating", cuda_build, "cuda")
    assert ops.implementation("topk_gating", "cpu") == "tideflow_kernels.cpu.topk_gating"
    assert ops.implementation("topk_gating", "cuda") == __name__

    logits = torch.randn(3, 8)
    weights, ids = ops.topk_gating(logits, 2, True)
    expected_weights, expected_ids = reference.topk_gating(logits, 2, True)
    assert torch.equal(ids, expected_ids) and torch.allclose(weights, expected_weights) and not cuda_calls

    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))  # only the device is read to route (no GPU here)
    assert ops.topk_gating(on_gpu, 2, True) == "computed by the cuda build" and cuda_calls == [on_gpu]

    meta_weights, _ = ops.topk_gating(torch.empty(3, 8, device="meta"), 2, True)
    assert meta_weights.device.type == "meta" and len(cuda_calls) == 1

    ops.use_reference(device="cuda")
    assert ops.implementation("topk_gating", "cuda") == "reference"
    assert ops.implementation("topk_gating", "cpu") == "tideflow_kernels.cpu.topk_gating"
    with pytest.raises(ValueError, match="cpu or cuda"):
        ops.use_compiled("topk_gating", cuda_build, "mps")
