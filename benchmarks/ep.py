"""DEP2 vs DEP1 tokens/s and dispatch/combine bytes per token, for each exchange transport.

Same requests, same total cores: DEP1 is one rank with every expert and all threads (also shown
with one thread, the per-rank share); DEP2 is two ranks with half the cores, half the experts and
half the requests each. On a 2-core machine shared with other work the point is that DEP2 scales
correctly (same logits, bounded transport bytes), not the speed-up, which is noisy here.

Run: python benchmarks/ep.py [--seqs 8] [--prompt-len 64] [--decode-steps 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
from engine.parallel.dep import DEPConfig  # noqa: E402
from engine.parallel.launch import run_ranks  # noqa: E402
from harness.dep_replay import ReplayJob, ReplayStep, SeqSpec, replay_rank  # noqa: E402

CONFIG = DEFAULT_CONFIG.model_copy(update=dict(
    vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, num_experts=8,
    intermediate_size=512, moe_intermediate_size=512,
))


def schedule(seqs: int, prompt_len: int, decode_steps: int, ranks: int, block_size: int) -> list[ReplayStep]:
    """Prefill every sequence, then decode steps; sequence i runs on rank i * ranks // seqs."""
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = (prompt_len + decode_steps + block_size - 1) // block_size
    owner = [i * ranks // seqs for i in range(seqs)]
    local = [owner[:i].count(owner[i]) for i in range(seqs)]
    table = [list(range(local[i] * blocks_per_seq, (local[i] + 1) * blocks_per_seq)) for i in range(seqs)]

    def step(lengths: list[int], starts: list[int]) -> ReplayStep:
        batches: list[list[SeqSpec]] = [[] for _ in range(ranks)]
        for i in range(seqs):
            tokens = torch.randint(0, CONFIG.vocab_size, (lengths[i],), generator=g).tolist()
            batches[owner[i]].append(SeqSpec(tokens=tokens, start=starts[i], block_table=table[i]))
        return ReplayStep(batches=batches)

    steps = [step([prompt_len] * seqs, [0] * seqs)]
    steps += [step([1] * seqs, [prompt_len + d] * seqs) for d in range(decode_steps)]
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, default=8, help="sequences in flight (split over the ranks)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    block_size = 16
    num_blocks = args.seqs * ((args.prompt_len + args.decode_steps) // block_size + 1)
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_default_model(Path(tmp), CONFIG)
        runs = [(1, "local", args.cores), (1, "local", 1)]
        runs += [(2, kind, max(1, args.cores // 2)) for kind in ("alltoall", "p2p", "allgather")]
        for ranks, kind, threads in runs:
            job = ReplayJob(
                dep=DEPConfig(model_dir=str(model_dir), num_blocks=num_blocks, block_size=block_size,
                              exchange="alltoall" if kind == "local" else kind),
                steps=schedule(args.seqs, args.prompt_len, args.decode_steps, ranks, block_size),
                threads_per_rank=threads,
            )
            results = run_ranks(replay_rank, ranks, job, timeout_s=600)
            logits = torch.cat([torch.tensor(r.logits[-1]).reshape(-1, CONFIG.vocab_size) for r in results])
            reference = logits if reference is None else reference
            tokens = sum(r.tokens for r in results)
            seconds = max(r.step_seconds for r in results)
            sent = sum(r.step_bytes for r in results)
            rows.append([f"DEP{ranks}", kind, f"{ranks}x{threads}", tokens / seconds, sent / tokens,
                         float((logits - reference).abs().max())])
    base = max(row[3] for row in rows if row[0] == "DEP1")  # the faster DEP1 is the fair baseline
    table = [row[:4] + [row[3] / base] + row[4:] for row in rows]
    elem = CONFIG.torch_dtype.itemsize
    print(f"model: hidden {CONFIG.hidden_size}, {CONFIG.num_layers} MoE layers, {CONFIG.num_experts} experts top-"
          f"{CONFIG.experts_per_token}; {args.seqs} seqs x ({args.prompt_len} prompt + {args.decode_steps} decode) tokens; "
          f"{args.cores} cores shared by the ranks")
    print_table(["instance", "exchange", "ranks x threads", "tokens/s", "vs best DEP1", "dispatch+combine B/token", "max |logit diff| vs DEP1"],
                table)
    per_remote = CONFIG.hidden_size * elem * 2 + 8 * CONFIG.experts_per_token
    print(f"\nbytes/token bound for DEP2: <= {CONFIG.num_layers} layers x 1 remote rank x {per_remote} B "
          f"(hidden out + hidden back + k weights/ids) = {CONFIG.num_layers * per_remote} B; "
          "allgather moves each rank's whole padded buffer to every rank")


if __name__ == "__main__":
    main()
