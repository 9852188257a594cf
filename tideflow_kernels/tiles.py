"""The tiled layout of expert weights: what the CPU's AMX tiles read as one linear stream.

An [E, R, K] stack of expert matrices keeps its shape and dtype, and each expert keeps its own slice
(so moving an expert between ranks moves the same bytes), but inside an expert the rows are stored as
[R/16][K/32][16][32]: every 16x32 tile of the matrix is one contiguous 1 KB. A tile load of row-major
weights gathers 16 rows 2K bytes apart; reading tiles in order streams memory front to back, which is
what bounds the MoE experts (tideflow_kernels/csrc/cpu/amx_tiles.h has the figures).
"""

from __future__ import annotations

import torch

TILE_ROWS, TILE_COLS = 16, 32


def tileable(w: torch.Tensor) -> bool:
    return w.dim() == 3 and w.shape[1] % TILE_ROWS == 0 and w.shape[2] % TILE_COLS == 0


def to_tiles(w: torch.Tensor) -> torch.Tensor:
    """Row-major [E, R, K] -> the same weights tiled (R % 16 == 0, K % 32 == 0)."""
    if not tileable(w):
        raise ValueError(f"tiled expert weights need [E, R, K] with R % {TILE_ROWS} == 0 and K % {TILE_COLS} == 0, "
                         f"got {list(w.shape)}")
    E, R, K = w.shape
    return w.reshape(E, R // TILE_ROWS, TILE_ROWS, K // TILE_COLS, TILE_COLS).transpose(2, 3).reshape(E, R, K)


def from_tiles(w: torch.Tensor) -> torch.Tensor:
    """Tiled [E, R, K] -> the same weights row-major."""
    E, R, K = w.shape
    return w.reshape(E, R // TILE_ROWS, K // TILE_COLS, TILE_ROWS, TILE_COLS).transpose(2, 3).reshape(E, R, K)
