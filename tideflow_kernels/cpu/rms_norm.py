"""Compiled CPU RMSNorm (fused with the residual add when one is given)."""

from __future__ import annotations

from tideflow_kernels.guard import expect


def make(lib):
    plain, fused = lib.rms_norm, lib.fused_add_rms_norm

    def rms_norm(x, weight, eps, residual=None):
        expect("rms_norm", "cpu", {"x": x, "weight": weight, "residual": residual})
        if residual is None:
            return plain(x, weight, float(eps)), x
        return tuple(fused(x, residual, weight, float(eps)))

    return rms_norm
