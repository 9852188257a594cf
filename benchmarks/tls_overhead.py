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

import os
import ssl
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compare_on_off, on_off_flags, pd_group_up, stream_rounds  # noqa: E402

from engine.group.groupset import GroupSetConfig, LocalGroupSet  # noqa: E402
from engine.runtime import tls  # noqa: E402


def fleet_run(model_dir: Path, home: Path, secure: bool, args, seed: int) -> tuple[float, float]:
    """(tok/s, TTFT p50 ms: the medians of its rounds) of one fleet started with TLS on or off."""
    os.environ["TIDEFLOW_HOME"] = str(home)
    for name in (tls.CERT_ENV, tls.KEY_ENV, tls.CA_ENV):  # the last fleet's identity is not this one's
        os.environ.pop(name, None)
    with LocalGroupSet(GroupSetConfig(model_dir=model_dir, tls=secure)) as gs:
        pd_group_up(gs, model_dir, {"kv_cache_bytes": 256 << 20, "max_num_seqs": args.streams}, transfer="tcp")
        verify = ssl.create_default_context(cafile=home / "tls" / "ca.pem") if secure else True
        return stream_rounds(gs, args, seed, verify)


def main() -> int:
    compare_on_off("TLS", on_off_flags(__doc__), fleet_run,
                   "PD group (1 prefill + 1 decode, KV over TCP) behind the router")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
