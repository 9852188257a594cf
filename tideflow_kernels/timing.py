"""Median wall time of two implementations, synchronising the device when the inputs live on a GPU."""

from __future__ import annotations

import statistics
import time

import torch


def compare_us(ours, baseline, args: tuple, iters: int, warmup: int = 3) -> tuple[float, float]:
    """Medians of two implementations timed alternately on the same inputs, so load from other
    processes on a shared machine hits both sides alike."""
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        ours(*args)
        baseline(*args)
    sync()
    a, b = [], []
    for _ in range(iters):
        for fn, samples in ((ours, a), (baseline, b)):
            t0 = time.perf_counter()
            fn(*args)
            sync()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(a), statistics.median(b)
