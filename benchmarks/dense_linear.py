"""Dense projections: the weight packed once for oneDNN (engine.model.packed_linear) vs torch's `F.linear` on
the plain weight (what nn.Linear runs: oneDNN reordering per call in bf16, the BLAS torch was built with in
fp32), on the default model's projection shapes, at the batches the engine runs (1: decode, 32: 32 streams,
128: a prompt). Prints microseconds and ratios (F.linear time / packed time), and which side the engine's
load-time measurement (`packing_pays`) picks per shape; the two are timed alternately so load from other
processes hits both.

    python benchmarks/dense_linear.py [--iters 200] [--dtype float32]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from engine.offline.default_model import DEFAULT_CONFIG  # noqa: E402
from engine.model.packed_linear import PackedLinear, packing_available, packing_pays  # noqa: E402
from tideflow_kernels.timing import compare_us  # noqa: E402


def shapes() -> list[tuple[str, int, int]]:
    c = DEFAULT_CONFIG
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return [("q / o projection", q, c.hidden_size), ("k or v projection", kv, c.hidden_size),
            ("lm_head", c.vocab_size, c.hidden_size)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    if not packing_available():
        print("this torch has no oneDNN linear packing: nothing to compare")
        return 1
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows, ratios, picks = [], [], []
    for name, out_f, in_f in shapes():
        linear = nn.Linear(in_f, out_f, bias=False, dtype=dtype)
        packed = PackedLinear(linear)
        picks.append([name, "packed" if packing_pays(linear, packed) else "plain"])
        for batch in (1, 32, 128):
            x = torch.randn(batch, in_f).to(dtype)
            with torch.inference_mode():
                ours, plain = compare_us(packed, lambda t: F.linear(t, linear.weight), (x,), args.iters)
            ratios.append(plain / ours)
            rows.append([name, f"{out_f}x{in_f}", batch, ours, plain, f"{plain / ours:.2f}x"])
    print(f"{args.dtype}, {args.threads} threads, median of {args.iters} alternating calls")
    print_table(["projection", "weight", "rows", "packed us", "F.linear us", "ratio"], rows)
    print(f"geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}x, min {min(ratios):.2f}x")
    print("the load-time measurement picks: " + ", ".join(f"{name} {pick}" for name, pick in picks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
