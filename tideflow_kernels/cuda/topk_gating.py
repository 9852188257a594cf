"""CUDA softmax + top-k + renormalise gating (warp per token)."""

from __future__ import annotations

import torch

from tideflow_kernels.cuda.library import check, dtype_code, stream
from tideflow_kernels.guard import expect


def make(lib):
    def topk_gating(logits, k, renormalize):
        expect("topk_gating", "cuda", {"logits": logits})
        logits = logits.contiguous()
        T, E = logits.shape
        weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
        check(lib.tf_topk_gating(logits.data_ptr(), weights.data_ptr(), ids.data_ptr(), T, E, k,
                                 int(bool(renormalize)), dtype_code(logits), stream()),
              "topk_gating")
        return weights, ids

    return topk_gating
