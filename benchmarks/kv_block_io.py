"""What moving one KV block between the cache and the tiers costs, ours against the obvious alternatives, in one run.

    python benchmarks/kv_block_io.py [--blocks 100] [--repeats 5] [--threads 1]

On the default model's cache (fp32, 256 KiB blocks of 16 tokens):
- out of the cache (offload) and back in (onboard): one tensor per block (engine/kvtier/block_copy.py) against
  one bytes object per block (index_select into a staging buffer, then tobytes / join + frombuffer), the way a
  byte-oriented store would take them;
- the record checksum: CRC-32 (zlib, ours) against BLAKE2b-128;
- a record written to and read back from a local directory (the disk tier) and from host memory.
Printed: milliseconds per block, best of `--repeats`, and the ratios. The engine thread pays the copies; the writer
and fetch threads pay the checksums and the file I/O.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host, print_table  # noqa: E402

from engine.offline.default_model import DEFAULT_CONFIG  # noqa: E402
from engine.kvtier.block_copy import as_bytes, export_each, import_each  # noqa: E402
from engine.kvtier.keys import decode, encode  # noqa: E402
from engine.kvtier.tiers import DiskTier  # noqa: E402
from engine.model.paged import allocate_kv_cache  # noqa: E402


def best_ms(fn, repeats: int, per: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best / per * 1e3


def bytes_export(kv, ids: list[int]) -> list[bytes]:
    """The byte-oriented way: one staging buffer [block, layer, K|V, ...], then a bytes object per block."""
    k0 = kv[0][0]
    staging = torch.empty((len(ids), len(kv), 2, *k0.shape[1:]), dtype=k0.dtype)
    index = torch.tensor(ids)
    for layer, (k, v) in enumerate(kv):
        staging[:, layer, 0].copy_(k.index_select(0, index))
        staging[:, layer, 1].copy_(v.index_select(0, index))
    return [row.view(-1).view(torch.uint8).numpy().tobytes() for row in staging]


def bytes_import(kv, ids: list[int], payloads: list[bytes]) -> None:
    k0 = kv[0][0]
    parts = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(k0.dtype).view(
        len(ids), len(kv), 2, *k0.shape[1:])
    index = torch.tensor(ids)
    for layer, (k, v) in enumerate(kv):
        k.index_copy_(0, index, parts[:, layer, 0])
        v.index_copy_(0, index, parts[:, layer, 1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engine thread's team)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.blocks
    kv = allocate_kv_cache(DEFAULT_CONFIG, 2 * n + 8, 16)
    for k, v in kv:
        k.normal_()
        v.normal_()
    src, dst = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
    tensors, payloads = export_each(kv, src), bytes_export(kv, src)
    block_kib = len(payloads[0]) >> 10
    rows = []

    ours = best_ms(lambda: export_each(kv, src), args.repeats, n)
    theirs = best_ms(lambda: bytes_export(kv, src), args.repeats, n)
    rows.append(["offload (cache -> host)", f"{ours:.3f}", f"{theirs:.3f}", f"{theirs / ours:.2f}x"])
    ours = best_ms(lambda: import_each(kv, dst, tensors), args.repeats, n)
    theirs = best_ms(lambda: bytes_import(kv, dst, payloads), args.repeats, n)
    rows.append(["onboard (host -> cache)", f"{ours:.3f}", f"{theirs:.3f}", f"{theirs / ours:.2f}x"])
    views = [as_bytes(t) for t in tensors]
    ours = best_ms(lambda: [zlib.crc32(v) for v in views], args.repeats, n)
    theirs = best_ms(lambda: [hashlib.blake2b(v, digest_size=16).digest() for v in views], args.repeats, n)
    rows.append(["checksum: CRC-32 vs BLAKE2b-128", f"{ours:.3f}", f"{theirs:.3f}", f"{theirs / ours:.2f}x"])

    records = [encode(f"kv/m/v/s/{i:016x}", v) for i, v in enumerate(views)]
    with tempfile.TemporaryDirectory(prefix="tideflow-kv-block-io-") as tmp:
        disk = DiskTier(Path(tmp), capacity=1 << 40, ttl_s=None)
        write = best_ms(lambda: [disk.put(f"kv/m/v/s/{i:016x}", r) for i, r in enumerate(records)], args.repeats, n)
        read = best_ms(lambda: [decode(f"kv/m/v/s/{i:016x}", disk.get(f"kv/m/v/s/{i:016x}"), len(views[0]))
                                for i in range(n)], args.repeats, n)
    rows.append(["disk tier, ours: write a record (first column), read and check it (second)", f"{write:.3f}",
                 f"{read:.3f}", "-"])
    print(f"host: {host()}; torch threads {args.threads}; {n} blocks of {block_kib} KiB (default model, fp32, "
          f"16 tokens), best of {args.repeats}")
    print_table(["per block", "ours ms", "alternative ms", "ratio"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
