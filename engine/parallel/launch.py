"""Start the ranks of a DEP instance as processes on this host, collect their results, always reap them."""

from __future__ import annotations

import queue
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from engine.runtime.errors import TideflowError
from engine.parallel import dist as pdist
from engine.parallel.dist import Backend, DistConfig
from engine.runtime.process import free_port


class RankError(TideflowError):
    """A rank failed or did not finish in time; the message carries its traceback or the timeout."""


def _entry(target: Callable[[DistConfig, Any], Any], config: DistConfig, payload: Any, results) -> None:
    try:
        pdist.init(config)
        try:
            results.put((config.rank, True, target(config, payload)))
        finally:
            pdist.shutdown()
    except BaseException:  # noqa: BLE001 - the parent reports it with the rank's traceback
        results.put((config.rank, False, traceback.format_exc()))


def run_ranks(
    target: Callable[[DistConfig, Any], Any], world_size: int, payload: Any, timeout_s: float = 120.0,
    backend: Backend | None = None,
) -> list[Any]:
    """Run `target(dist_config, payload)` on `world_size` spawned ranks; returns their results by rank.

    `target` must be importable (spawned processes re-import it). Any rank failing, or the whole
    instance taking longer than `timeout_s`, raises RankError; every process is reaped either way.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, daemon=True, name=f"dep-rank-{rank}", args=(
            target, DistConfig(rank=rank, world_size=world_size, port=port, backend=backend,
                               timeout_s=timeout_s), payload, results))
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RankError(f"{', '.join(dead)} exited without a result") from None
                if time.monotonic() > deadline:
                    raise RankError(f"DEP{world_size} did not finish within {timeout_s:.0f}s") from None
                continue
            if not ok:
                raise RankError(f"rank {rank} of DEP{world_size} failed:\n{value}")
            out[rank] = value
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
