"""Decode tokens/s: tideflow's generation loop vs transformers generate() on the same checkpoint.

Run: python benchmarks/decode.py [--batches 1 8 32] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbs, print_table  # noqa: E402

from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
from engine.offline.generate import GenerationStats, generate  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from harness.gpu_check import hf_decode_rate  # noqa: E402
from tideflow_kernels.startup import startup_ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--reference-ops", action="store_true", help="keep the torch reference ops even when a compiled build is cached")
    args = ap.parse_args()
    compiled = startup_ops("native", "reference" if args.reference_ops else "auto")  # as `serve` starts
    print(f"ops: {', '.join(sorted(compiled)) or 'torch reference'} compiled")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_default_model(Path(tmp), DEFAULT_CONFIG.model_copy(update={"dtype": args.dtype}))
        ours = load_model(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        rows = []
        for batch in args.batches:
            prompts = torch.randint(0, DEFAULT_CONFIG.vocab_size, (batch, args.prompt_len)).tolist()
            params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
            generate(ours, None, prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))
            stats = GenerationStats()
            generate(ours, None, prompts, params, stats=stats)
            ids = torch.randint(0, hf.config.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
            theirs = hf_decode_rate(hf, ids, args.new_tokens)
            rows.append([batch, stats.decode_tokens_per_s, theirs, stats.decode_tokens_per_s / theirs])
        bw = copy_bandwidth_gbs()
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    active_bytes = DEFAULT_CONFIG.param_count(active=True) * elem
    roofline = bw * 1e9 / active_bytes
    print(f"model: {DEFAULT_CONFIG.param_count() / 1e6:.1f}M params, {active_bytes / 1e6:.0f} MB active per token ({args.dtype}); "
          f"{torch.get_num_threads()} threads")
    print_table(["batch", "tideflow tok/s", "transformers tok/s", "ratio"], rows)
    print(f"\nmemory roofline at batch 1: copy bandwidth {bw:.1f} GB/s / {active_bytes / 1e6:.0f} MB = {roofline:.1f} tok/s; "
          f"tideflow reaches {rows[0][1] / roofline:.0%} of it" if args.batches[0] == 1 else "")


if __name__ == "__main__":
    main()
