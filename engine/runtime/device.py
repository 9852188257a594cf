"""The torch device a serving process computes on, checked before anything is loaded onto it."""

from __future__ import annotations

import torch

from engine.runtime.errors import TideflowError


class DeviceError(TideflowError):
    """The device asked for cannot be used here."""


def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda` (the first GPU this process sees) or `cuda:i`; a clear error when torch cannot reach it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"--device {name!r} is not a device: give cpu, cuda or cuda:<index>") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceError(f"--device {name!r}: tideflow serves on cpu or cuda, not {device.type}")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {name}: torch sees no CUDA device (torch {torch.__version__} is "
                          f"{'a CPU build' if torch.version.cuda is None else 'built for CUDA ' + torch.version.cuda}; "
                          "check the driver and CUDA_VISIBLE_DEVICES)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceError(f"--device {name}: this process sees {count} GPU(s), cuda:0..cuda:{count - 1}")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device`, copied without a host sync: a blocking copy to a GPU first waits
    for all the work queued before it, once per tensor of every step."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
