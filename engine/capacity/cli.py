"""`tideflow profile`: measure one role shape and write its profile (engine.capacity.profile) as JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError



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

    q = subparsers.add_parser("plan", help="members per hour for TTFT/ITL targets from role profiles and a forecast")
    q.add_argument("--profile", type=Path, required=True, help="a `tideflow profile` JSON (prefill, and decode unless "
                                                               "--decode-profile)")
    q.add_argument("--decode-profile", type=Path, default=None, help="the decode role's profile, when its shape differs")
    q.add_argument("--ttft-ms", type=float, required=True, help="TTFT p90 target")
    q.add_argument("--itl-ms", type=float, required=True, help="inter-token latency p90 target")
    q.add_argument("--input-tokens", type=int, required=True, help="prompt tokens of a typical request")
    q.add_argument("--output-tokens", type=int, required=True, help="tokens generated for a typical request")
    q.add_argument("--forecast", default="tidal", metavar="tidal|FILE.csv",
                   help="`hour,rps` rows for hours 0-23, or the built-in tidal day (--night-rps, --peak-rps)")
    q.add_argument("--night-rps", type=float, default=0.5)
    q.add_argument("--peak-rps", type=float, default=6.0)
    q.add_argument("--timezone", default="UTC", help="the zone of the forecast's hours")
    q.add_argument("--headroom", type=float, default=0.15, help="provision this much over the forecast (0.15: 15 %%)")
    q.add_argument("--cold-start-s", type=float, default=120.0, help="a member's start to Ready: how early ramps start")
    q.add_argument("--member-memory-bytes", type=int, default=None, help="memory a member may hold (weights + KV)")
    q.add_argument("--ttft-correction", type=float, default=1.0,
                   help="measured / predicted TTFT of a served member (benchmarks/plan_check.py prints it)")
    q.add_argument("--itl-correction", type=float, default=1.0, help="measured / predicted ITL of a served member")
    q.add_argument("--out", type=Path, default=None, help="also write the plan as JSON here")
    q.set_defaults(func=_plan)


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


def _plan(args: argparse.Namespace) -> int:
    from engine.capacity.forecast import TidalShape, from_csv
    from engine.capacity.plan import SLO, PlanSpec, as_table, plan
    from engine.capacity.profile import RoleProfile
    from tideflow_kernels.atomic_file import atomic_write_text

    def read(path: Path) -> RoleProfile:
        try:
            return RoleProfile.model_validate_json(path.read_text())
        except OSError as exc:
            raise ValueError(f"profile {path}: cannot be read ({exc.strerror})") from None
        except ValidationError as exc:
            raise ValueError(f"profile {path} is not a `tideflow profile` JSON: {exc}") from None

    spec = PlanSpec(slo=SLO(ttft_p90_s=args.ttft_ms / 1000, itl_p90_s=args.itl_ms / 1000),
                    input_tokens=args.input_tokens, output_tokens=args.output_tokens, headroom=args.headroom,
                    cold_start_s=args.cold_start_s, member_memory_bytes=args.member_memory_bytes,
                    ttft_correction=args.ttft_correction, itl_correction=args.itl_correction)
    forecast = (TidalShape(night_rps=args.night_rps, peak_rps=args.peak_rps).forecast(args.timezone)
                if args.forecast == "tidal" else from_csv(Path(args.forecast), args.timezone))
    result = plan(spec, forecast, read(args.profile), read(args.decode_profile) if args.decode_profile else None)
    print(as_table(result))
    if args.out:
        atomic_write_text(args.out, result.model_dump_json(indent=2))
        print(f"written: {args.out}")
    return 0
