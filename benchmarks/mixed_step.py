"""A model step that mixes decodes with a prefill chunk (what chunked prefill makes of a busy engine): the decodes
through the paged decode kernel and the chunk through torch's fused attention (ours), against every sequence
through torch's fused attention over its gathered context (`F.scaled_dot_product_attention` per sequence: what
the engine did for a mixed step before), side by side on the same batch.

    python benchmarks/mixed_step.py [--decodes 12] [--context 3000] [--chunk 128] [--chunk-context 1500]
                                    [--dtype float32] [--repeats 7] [--kernels auto]

The default model's step (weights, KV cache, the kernels `tideflow serve` uses), on the engine's threads
(all the process may use). Printed: the step's median time both ways and the ratio, for the decodes beside the
chunk and beside a newcomer's whole 64-token prompt (a step of decodes alone takes the paged kernel both ways).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host, print_table  # noqa: E402

from engine.runtime import intraop  # noqa: E402
from engine.core.model_runner import ModelRunner, SeqStep  # noqa: E402
from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
from engine.model import paged  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from tideflow_kernels.startup import startup_ops  # noqa: E402

BLOCK = 16


def table(i: int, tokens: int, stride: int) -> list[int]:
    return list(range(i * stride, i * stride + (tokens + BLOCK - 1) // BLOCK))


def timed(runner: ModelRunner, seqs: list[SeqStep], repeats: int) -> float:
    runner.step(seqs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.step(seqs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodes", type=int, default=12)
    ap.add_argument("--context", type=int, default=3000, help="tokens each decoding sequence holds")
    ap.add_argument("--chunk", type=int, default=128, help="tokens of the prefill chunk")
    ap.add_argument("--chunk-context", type=int, default=1500, help="tokens cached before the chunk")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kernels", default="auto", choices=["auto", "cached", "reference"])
    args = ap.parse_args()

    intraop.serial_process()
    startup_ops("native", args.kernels)
    with tempfile.TemporaryDirectory(prefix="tideflow-mixed-") as tmp:
        model = load_model(write_default_model(Path(tmp) / "model", DEFAULT_CONFIG, seed=0), args.dtype)
    intraop.claim()
    stride = (max(args.context, args.chunk_context + args.chunk) + BLOCK - 1) // BLOCK + 1
    runner = ModelRunner(model, stride * (args.decodes + 2), BLOCK)
    decodes = [SeqStep([5], args.context, table(i, args.context + 1, stride)) for i in range(args.decodes)]
    chunk = SeqStep([5] * args.chunk, args.chunk_context, table(args.decodes, args.chunk_context + args.chunk, stride))
    prompt = SeqStep([5] * 64, 0, table(args.decodes + 1, 64, stride))
    cases = [(f"decodes + {args.chunk}-token chunk", decodes + [chunk]), ("decodes + a 64-token prompt", decodes + [prompt])]

    build = paged.AttentionMetadata.build
    rows = []
    for name, seqs in cases:
        ours = timed(runner, seqs, args.repeats)
        paged.AttentionMetadata.build = classmethod(  # every sequence through the prefill path: the baseline
            lambda cls, *a, **k: replace(build(*a, **k), num_decodes=0))
        try:
            sdpa = timed(runner, seqs, args.repeats)
        finally:
            paged.AttentionMetadata.build = build
        rows.append([name, f"{ours:.1f}", f"{sdpa:.1f}", f"{sdpa / ours:.2f}x"])
    print(f"host: {host()}; default model, {args.dtype}, {torch.get_num_threads()} threads; {args.decodes} decodes "
          f"at {args.context} tokens, chunk {args.chunk} after {args.chunk_context}")
    print_table(["step", "ours ms (paged decodes)", "SDPA per sequence ms", "speed-up"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
