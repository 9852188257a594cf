"""The one check every compiled op makes before touching its inputs' memory.

The CPU build reads host pointers and the CUDA build device pointers; handed a tensor of the other device
(or of a dtype it has no code for), an op would crash the process or read garbage. tideflow_kernels.ops already routes
each call to the build of its tensors' device, so this fires only on a direct call or a mixed-device call.
"""

from __future__ import annotations

import torch

from tideflow_kernels.errors import KernelInputError

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def expect(op: str, device: str, floats: dict[str, torch.Tensor | None],
           others: dict[str, torch.Tensor | None] | None = None) -> None:
    """Every tensor on a `device`-type device; every float tensor float32 or bfloat16."""
    for name, t in (floats | (others or {})).items():
        if t is not None and t.device.type != device:
            raise KernelInputError(f"{op}: the compiled {device} build was handed {name} on {t.device}; "
                                   f"it computes on {device} tensors only (tideflow_kernels.ops routes each device to its build)")
    for name, t in floats.items():
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise KernelInputError(f"{op}: {name} is {t.dtype}; the compiled ops take float32 or bfloat16")
