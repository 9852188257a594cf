"""The serving device is checked at the boundary (the engine config) and before anything loads onto it."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engine.runtime.device import DeviceError, resolve_device
from engine.core.engine_config import EngineConfig


def test_cpu_resolves_and_unknown_devices_are_refused_by_name():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="not a device"):
        resolve_device("gpu0")
    with pytest.raises(DeviceError, match="cpu or cuda, not mps"):
        resolve_device("mps")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_cuda_without_a_gpu_says_why():
    with pytest.raises(DeviceError, match=r"--device cuda: torch sees no CUDA device .*CUDA_VISIBLE_DEVICES"):
        resolve_device("cuda")


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", ""])
def test_engine_config_refuses_a_malformed_device(device):
    with pytest.raises(ValidationError, match="device"):
        EngineConfig(device=device)
    assert EngineConfig(device="cuda:1").device == "cuda:1"
