"""What TLS costs: the same PD fleet (router -> prefill -> decode, separate processes, KV over the TCP transport)
with TLS on every hop (the router serves HTTPS, mutual TLS router -> member and prefill -> decode KV, from a fleet
CA) and off (plain HTTP and TCP), the same streams through the official openai client, runs alternating on/off
so drift of the machine hits both alike.

    python benchmarks/tls_overhead.py [--streams 32] [--prompt-len 64] [--output-len 64] [--repeats 3] [--rounds 3]

Prints output tokens/s and TTFT p50 per fleet (the median of its rounds), the medians, and the ratio on/off.
The client keeps its connections (as the openai client does), so the handshakes are few; what is measured is
mostly encryption of the streams and of the KV.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host, pd_group_up, print_table, run_streams  # noqa: E402

from engine.group.groupset import GroupSetConfig, LocalGroupSet  # noqa: E402
from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
from engine.runtime import tls  # noqa: E402


def fleet_run(model_dir: Path, home: Path, secure: bool, args, seed: int) -> tuple[float, float]:
    """(tok/s, TTFT p50 ms: the medians of its rounds) of one fleet started with TLS on or off."""
    os.environ["TIDEFLOW_HOME"] = str(home)
    for name in (tls.CERT_ENV, tls.KEY_ENV, tls.CA_ENV):  # the last fleet's identity is not this one's
        os.environ.pop(name, None)
    with LocalGroupSet(GroupSetConfig(model_dir=model_dir, tls=secure)) as gs:
        pd_group_up(gs, model_dir, {"kv_cache_bytes": 256 << 20, "max_num_seqs": args.streams}, transfer="tcp")
        verify = ssl.create_default_context(cafile=home / "tls" / "ca.pem") if secure else True
        asyncio.run(run_streams(gs.url, gs.client_key, 4, args.prompt_len, 8, seed + 1, verify))  # warm-up
        runs = [asyncio.run(run_streams(gs.url, gs.client_key, args.streams, args.prompt_len, args.output_len,
                                        seed * 100 + i, verify)) for i in range(args.rounds)]
    return statistics.median(r for r, _ in runs), statistics.median(t for _, t in runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64, help="words per prompt")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="fleets per mode, alternating on and off")
    ap.add_argument("--rounds", type=int, default=3, help="measured runs of the streams per fleet (their median)")
    args = ap.parse_args()
    rows, figures = [], {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_default_model(Path(tmp) / "model", DEFAULT_CONFIG, seed=0)
        for r in range(args.repeats):
            for secure in ((True, False) if r % 2 == 0 else (False, True)):
                rate, ttft = fleet_run(model_dir, Path(tmp) / f"home-{r}-{secure}", secure, args, seed=r)
                figures[secure].append((rate, ttft))
                rows.append([r, "on" if secure else "off", f"{rate:.0f}", f"{ttft:.0f}"])
                print(f"run {r} TLS {'on' if secure else 'off'}: {rate:.0f} tok/s, TTFT p50 {ttft:.0f} ms", flush=True)
    print(f"\n{host()}; default model, float32, PD group (1 prefill + 1 decode, KV over TCP) behind the router, "
          f"{args.streams} streams, {args.prompt_len} words in / {args.output_len} tokens out, greedy")
    print_table(["run", "TLS", "tok/s", "TTFT p50 ms"], rows)
    on_rate, off_rate = (statistics.median(r for r, _ in figures[m]) for m in (True, False))
    on_ttft, off_ttft = (statistics.median(t for _, t in figures[m]) for m in (True, False))
    print(f"\nmedians: on {on_rate:.0f} tok/s, off {off_rate:.0f} tok/s: throughput on/off {on_rate / off_rate:.3f} "
          f"(cost {100 * (1 - on_rate / off_rate):+.1f} %); TTFT p50 on/off {on_ttft / off_ttft:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
