"""CUDA RMSNorm fused with the residual add (block per row)."""

from __future__ import annotations

import torch

from tideflow_kernels.cuda.library import check, dtype_code, stream
from tideflow_kernels.guard import expect


def make(lib):
    def rms_norm(x, weight, eps, residual=None):
        expect("rms_norm", "cuda", {"x": x, "weight": weight, "residual": residual})
        x = x.contiguous()
        w = weight.contiguous()
        out = torch.empty_like(x)
        res = residual.contiguous() if residual is not None else None
        res_out = torch.empty_like(x) if res is not None else None
        hidden = x.shape[-1]
        check(lib.tf_rms_norm(x.data_ptr(), res.data_ptr() if res is not None else None,
                              w.data_ptr(), out.data_ptr(),
                              res_out.data_ptr() if res_out is not None else None,
                              x.numel() // max(hidden, 1), hidden, float(eps), dtype_code(x),
                              dtype_code(w), stream()), "rms_norm")
        return out, (res_out if res_out is not None else x)

    return rms_norm
