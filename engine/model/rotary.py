"""Rotary position embedding tables (rotate-half convention, as in HF Llama/Mixtral/Qwen)."""

from __future__ import annotations

import torch


def cos_sin_table(head_dim: int, max_positions: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos in the first half of the columns, sin in the second."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return table if device is None else table.to(device)
