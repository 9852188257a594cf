"""The tiled layout of expert weights: what the CPU kernels read as one linear stream.

An [E, R, K] stack of expert matrices keeps its shape and dtype, and each expert keeps its own slice
(so moving an expert between ranks moves the same bytes), but inside an expert the rows are stored as
[R/16][K/c][16][c]: blocks of 16 rows, each block a sequence of 16 x c tiles, one contiguous run of memory
each. The tile width c depends on the dtype:
- bf16, c = 32: a tile is one AMX tile (1 KB). A tile load of row-major weights gathers 16 rows 2K bytes
  apart; reading tiles in order streams memory front to back (tideflow_kernels/csrc/cpu/amx_tiles.h).
- fp32, c = 1: at every k the block's 16 weights are one vector, the operand of the outer products in
  tideflow_kernels/csrc/cpu/f32_tiles.h.
"""

from __future__ import annotations

import torch

TILE_ROWS = 16


def tile_cols(dtype: torch.dtype) -> int:
    """Elements of one tile row: 1 for fp32, 32 for the AMX tiles' bf16."""
    return 1 if dtype == torch.float32 else 32


def tileable(w: torch.Tensor) -> bool:
    return w.dim() == 3 and w.shape[1] % TILE_ROWS == 0 and w.shape[2] % tile_cols(w.dtype) == 0


def to_tiles(w: torch.Tensor) -> torch.Tensor:
    """Row-major [E, R, K] -> the same weights tiled (R % 16 == 0, K % tile_cols == 0)."""
    if not tileable(w):
        raise ValueError(f"tiled {w.dtype} expert weights need [E, R, K] with R % {TILE_ROWS} == 0 and "
                         f"K % {tile_cols(w.dtype)} == 0, got {list(w.shape)}")
    E, R, K = w.shape
    c = tile_cols(w.dtype)
    return w.reshape(E, R // TILE_ROWS, TILE_ROWS, K // c, c).transpose(2, 3).reshape(E, R, K)


def from_tiles(w: torch.Tensor) -> torch.Tensor:
    """Tiled [E, R, K] -> the same weights row-major."""
    E, R, K = w.shape
    c = tile_cols(w.dtype)
    return w.reshape(E, R // TILE_ROWS, K // c, TILE_ROWS, c).transpose(2, 3).reshape(E, R, K)
