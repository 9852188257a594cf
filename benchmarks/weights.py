"""Weights publish throughput: ours vs the obvious baseline, on a moto S3 server and the FS store.

Baseline = upload (boto3 `upload_file`, default settings / `shutil.copyfile` for the FS store)
followed by a separate SHA-256 pass, i.e. what a publish without our single-read pipeline does.
Also prints our throughput as a share of this machine's single-thread SHA-256 rate, the
ceiling for any publish that must hash every byte.

    python benchmarks/weights.py --size-gb 2
"""

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import boto3

from harness.moto import start_moto
from engine.weights import publish
from engine.weights.config import MiB

CHUNK = 8 * MiB


def make_checkpoint(root: Path, total_bytes: int, shards: int) -> None:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "bench-moe", "hidden_size": 4096}))
    per = total_bytes // shards
    block = os.urandom(64 * MiB)
    for i in range(shards):
        with open(root / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            left = per
            while left:
                # A fresh random prefix per block keeps every part distinct (no dedup by accident).
                chunk = os.urandom(4096) + block[4096:min(len(block), left)]
                f.write(chunk[:left])
                left -= min(len(chunk), left)


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file())


def sha256_pass(paths: list[Path]) -> None:
    for p in paths:
        h = hashlib.sha256()
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def empty_bucket(client, bucket: str) -> None:
    """Free the server's memory between rounds."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GB (default 2)")
    ap.add_argument("--shards", type=int, default=4, help="safetensors-like files")
    ap.add_argument("--part-size-mib", type=int, default=64, help="our part size")
    ap.add_argument("--concurrency", type=int, default=8, help="our parts in flight")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; best of each is reported")
    ap.add_argument("--skip-s3", action="store_true", help="only the filesystem store")
    args = ap.parse_args()
    if args.size_gb <= 0 or args.rounds < 1:
        ap.error("--size-gb and --rounds must be positive")

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    total = int(args.size_gb * 1e9)
    with tempfile.TemporaryDirectory(prefix="tideflow-bench-") as tmp:
        tmp = Path(tmp)
        ckpt = tmp / "ckpt"
        make_checkpoint(ckpt, total, args.shards)
        paths = files_of(ckpt)
        nbytes = sum(p.stat().st_size for p in paths)
        mb = nbytes / 1e6
        sha256_pass(paths)  # warm the page cache so every contender reads from memory
        ours = dict(part_size=args.part_size_mib * MiB, max_concurrency=args.concurrency)
        best: dict[str, float] = {}
        cpu: dict[str, float] = {}

        def measure(name: str, fn, cleanup=None) -> None:
            os.sync()  # start each run with no dirty pages of the previous one
            seconds, cpu_s = timed(fn)
            if seconds < best.get(name, float("inf")):
                best[name], cpu[name] = seconds, cpu_s
            if cleanup is not None:
                cleanup()

        fs_base, fs_ours = tmp / "fs-baseline", tmp / "fs-ours"

        def fs_baseline() -> None:
            fs_base.mkdir()
            for p in paths:
                shutil.copyfile(p, fs_base / p.name)
            sha256_pass(paths)

        proc = client = None
        if not args.skip_s3:
            proc, endpoint = start_moto(tmp / "moto.log")
            client = boto3.client("s3", endpoint_url=endpoint)
            client.create_bucket(Bucket="bench")
            os.environ["TIDEFLOW_S3_ENDPOINT_URL"] = endpoint

        def s3_baseline(round_: int) -> None:
            for p in paths:
                client.upload_file(str(p), "bench", f"baseline/{round_}/{p.name}")
            sha256_pass(paths)

        try:
            # Rounds alternate contenders so a noisy neighbour hurts both alike; best of rounds wins.
            for r in range(args.rounds):
                measure("sha256", lambda: sha256_pass(paths))
                measure("fs-base", fs_baseline, lambda: shutil.rmtree(fs_base))
                measure("fs-ours", lambda: publish(ckpt, fs_ours.as_uri() + "/", **ours),
                        lambda: shutil.rmtree(fs_ours))
                if client is not None:
                    measure("s3-base", lambda: s3_baseline(r), lambda: empty_bucket(client, "bench"))
                    measure("s3-ours", lambda: publish(ckpt, f"s3://bench/models/bench/v{r}/", **ours),
                            lambda: empty_bucket(client, "bench"))
        finally:
            if proc is not None:
                proc.stop()

    sha_rate = mb / best["sha256"]
    rows = [("filesystem", "copyfile + sha256", "fs-ours", "fs-base")]
    if "s3-ours" in best:
        rows.append(("moto S3 (local)", "upload_file + sha256", "s3-ours", "s3-base"))
    print(f"checkpoint: {mb:.0f} MB in {len(paths)} files; cpus: {os.cpu_count()}; "
          f"load average at end: {os.getloadavg()[0]:.1f}; best of {args.rounds} rounds; "
          f"our part size {args.part_size_mib} MiB x {args.concurrency} in flight")
    print(f"sha256 (one thread, page cache): {sha_rate:.0f} MB/s")
    print(f"{'store':<18}{'baseline':<24}{'ours MB/s':>10}{'base MB/s':>11}{'ours/base':>11}"
          f"{'ours/sha256':>13}{'client cpu s ours/base':>24}")
    for store, base, o, b in rows:
        ours_rate, base_rate = mb / best[o], mb / best[b]
        print(f"{store:<18}{base:<24}{ours_rate:>10.0f}{base_rate:>11.0f}{ours_rate / base_rate:>10.2f}x"
              f"{ours_rate / sha_rate:>12.0%}{cpu[o]:>15.1f} / {cpu[b]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
