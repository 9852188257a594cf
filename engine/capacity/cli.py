"""`tideflow profile`: measure one role shape and write its profile (engine.capacity.profile) as JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path



def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help="measure a role shape for capacity planning: prefill TTFT and tok/s, "
                                              "decode ITL and tok/s, the memory sums")
    p.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the default model)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:<index>")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="the KV budget a member of the role gets")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--input-lens", type=int, nargs="+", default=[64, 256, 1024], metavar="N")
    p.add_argument("--prefill-batches", type=int, nargs="+", default=[1, 4], metavar="N")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], metavar="N")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024], metavar="N")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per sequence at each decode point")
    p.add_argument("--out", type=Path, default=None,
                   help="where the JSON goes (default: $TIDEFLOW_HOME/profiles/<model dir>-<dtype>-<device>.json)")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from engine.capacity.profile import ProfileSpec, as_markdown, profile_role, save_profile

    spec = ProfileSpec(model_dir=args.model, device=args.device, dtype=args.dtype, kv_cache_bytes=args.kv_cache_bytes,
                       max_num_seqs=args.max_num_seqs, input_lens=args.input_lens,
                       prefill_batches=args.prefill_batches, concurrency=args.concurrency, contexts=args.contexts,
                       decode_tokens=args.decode_tokens)
    result = profile_role(spec, progress=lambda msg: print(f"profile: {msg}", file=sys.stderr, flush=True))
    out = save_profile(result, args.out)
    print(as_markdown(result))
    print(f"written: {out}")
    return 0
