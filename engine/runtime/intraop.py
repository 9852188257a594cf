"""Intra-op threads belong to the engine thread: every other thread of a serving process runs its torch
ops inline.

Why: torch's CPU ops (and the compiled ops) run their parallel loops on libgomp. libgomp gives every
thread that starts a parallel region its own pool of worker threads, and once the pools of a process
together hold more threads than it has cores, the workers stop spinning between regions and go to
sleep, so every parallel op pays a wake-up. A serving process loads the model and verifies its ops on
the main thread, then steps the model on the engine thread: two pools. Measured on a 2-core host
(`python benchmarks/profile_engine.py --batches 1`): a 1024x512 projection at batch 1 took 20 us on a
thread holding the only pool and 110 us beside a second pool, and batch-1 decode of the default model
ran at half speed. The same happens when any other thread (the event loop's workers, a warm-up thread)
runs a parallel op while the engine lives.

The rule, in one place:
- `serial_process()` first thing in a process that serves, before any torch op: torch's thread count
  becomes 1, so the main thread never holds a pool. It records the engine thread's count: `serve
  --threads`, which a group member gets from its CPU share (several members on one host must not each
  spin on every core), or the count the process was given (OMP_NUM_THREADS, or torch's default).
- The engine thread calls `claim()` before its first step: its ops use the recorded count. Work that
  would run parallel ops elsewhere (the KV cache's allocation) goes through the engine thread.
- Nothing sets the count again while the engine runs: a later `torch.set_num_threads(1)` from any other
  thread halved the compiled MoE op's speed on the engine thread in the same measurement.
- `claim()` also pins the engine's team, thread i to the i-th CPU the process may run on, when those CPUs
  are exactly as many as the team (a pod with an exclusive cpuset, `taskset`, a host of its own) and a
  CPU kernel build is loaded: the OS then never moves a team thread off its core, and each parallel
  region stops waiting for a thread that was moved (vLLM's CPU engine pins its team the same way).
  Measured: `tideflow serve`, bf16, 32 streams on 2 cores, A/B twice: 1388 / 1414 -> 1474 / 1465 tok/s.
  When the process may run on more CPUs than its team (several members sharing a host), nothing is
  pinned: the CPUs are not the team's alone.

A process that never calls `serial_process()` (tests, notebooks) keeps torch's defaults everywhere.
"""

from __future__ import annotations

import logging
import os

import torch

from tideflow_kernels import ops

log = logging.getLogger(__name__)

_engine_threads: int | None = None  # process-wide, as the OpenMP runtime it configures


def serial_process(threads: int | None = None) -> int:
    """Make torch ops serial on this thread and record the engine thread's count: `threads`, or the count
    the process was given (a group member gets its CPU share: `serve --threads`)."""
    global _engine_threads
    if _engine_threads is None:
        _engine_threads = threads or torch.get_num_threads()
        torch.set_num_threads(1)
    return _engine_threads


def claim() -> list[int] | None:
    """On the engine thread: its ops use the count `serial_process()` recorded (if it ran), its team pinned
    when the process's CPUs are the team's alone; returns the CPUs the team was pinned to, or None."""
    if _engine_threads is None:
        return None
    torch.set_num_threads(_engine_threads)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) != _engine_threads:
        return None
    pinned = ops.bind_threads(cpus)
    if pinned is not None:
        log.info("engine threads pinned to CPUs %s", ", ".join(map(str, cpus)))
    return pinned
