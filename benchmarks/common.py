"""Helpers shared by the benchmark scripts: tables and the machine's memory copy bandwidth."""

from __future__ import annotations

import time

import torch


def copy_bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """Best-of-n large tensor copy rate (read + write bytes per second): the memory roofline."""
    src = torch.empty(mbytes * 2**20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best / 1e9


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [headers] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))
