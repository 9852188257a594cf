"""A DEP rank as a serving engine: LLMEngine over a lockstep runner, one HTTP server per rank.

Every rank schedules its own requests (attention and KV cache are per rank) while the MoE layers
exchange tokens with the peers, so every rank must run every step of the instance. `DEPRunner`
keeps the ModelRunner API for the engine and adds `idle`, which an engine with nothing to run
calls instead of sleeping on its wake event: it joins the peers' step (an empty pass) or, when
nobody has work, waits a few milliseconds and returns. Every engine iteration is thus exactly one
collective step on every rank, and live rebalances run at the same step count everywhere.

A DEP instance is atomic: a failed step (a dead peer closes the collective, a stuck one hits the
process group timeout) exits the process non-zero, and the group manager rebuilds the whole group.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from engine.runtime.errors import EXIT_PEER_LOST, exit_member
from engine.parallel.expert_lb import ExpertLBConfig
from engine.core.engine_config import EngineConfig
from engine.core.engine_config import DEFAULT_KV_FRACTION
from engine.core.llm_engine import LLMEngine
from engine.core.model_runner import SeqStep
from engine.parallel import dist as pdist
from engine.parallel.dep import DEPConfig, DEPRank
from engine.parallel.serve_args import DEPServeConfig
from engine.telemetry.metrics import ServingMetrics
from engine.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

COUNT_EVERY_STEPS = 16


class DEPRunner:
    """ModelRunner's API (`step`, `kv_cache`, `block_size`, `num_blocks`) over one DEPRank, in lockstep."""

    lockstep = True

    def __init__(self, rank: DEPRank, metrics: ServingMetrics, idle_wait_s: float = 0.002) -> None:
        self.rank = rank
        self.model, self.config = rank.model, rank.config
        self.idle_wait_s = idle_wait_s
        self.rebalances = metrics.factory.counter("expert_rebalances_total", "live expert rebalances this rank applied")
        self.rebalance_failures = metrics.factory.counter(
            "expert_rebalance_failures_total", "expert rebalances refused or failed (the old placement kept)")
        self.rebalance_seconds = metrics.factory.histogram(
            "expert_rebalance_seconds", "one live rebalance check that moved experts: the load summed over the ranks, "
                                        "the plan, and the move (every rank stalls for it)")
        self.computed = metrics.factory.counter(
            "expert_computed_pairs_total", "(token, expert) pairs this rank's experts computed, the rank's load; "
                                           "updated every few steps")
        self._counted = self._counted_at = 0
        self._last_check = 0

    @property
    def kv_cache(self):
        return self.rank.runner.kv_cache

    @property
    def block_size(self) -> int:
        return self.rank.runner.block_size

    @property
    def num_blocks(self) -> int:
        return self.rank.runner.num_blocks

    @property
    def device(self) -> torch.device:
        return self.rank.device

    def allocate(self, num_blocks: int) -> None:
        self.rank.runner.allocate(num_blocks)

    def release(self) -> None:
        self.rank.runner.release()

    def step(self, seqs: list[SeqStep]) -> torch.Tensor:
        """Collective: this rank's logits, then a rebalance when the expert LB says one is due."""
        try:
            logits = self.rank.step(seqs)
            steps = self.rank.steps
            if steps - self._counted_at >= COUNT_EVERY_STEPS:  # one read back of the device counter, not one a
                computed = int(self.rank.dispatch.computed)      # step (nor one per idle poll between steps)
                self.computed.inc(computed - self._counted)
                self._counted, self._counted_at = computed, steps
            if steps != self._last_check and self.rank.lb.due(steps):
                self._last_check = steps
                failed, t0 = self.rank.failed_moves, time.perf_counter()
                if self.rank.rebalance() is not None:
                    took = time.perf_counter() - t0
                    self.rebalances.inc()
                    self.rebalance_seconds.observe(took)
                    log.info("DEP rank %d: experts rebalanced at step %d in %.2f s", self.rank.rank, steps, took)
                self.rebalance_failures.inc(self.rank.failed_moves - failed)
            return logits
        except Exception:
            exit_member(EXIT_PEER_LOST, f"DEP rank {self.rank.rank}: a collective step failed (a peer died or "
                                        "timed out)", exc_info=True)
            raise

    def idle(self, wake: threading.Event) -> None:
        """Join the peers' step with an empty batch; wait briefly (or until woken) when nobody worked."""
        before = self.rank.steps
        self.step([])
        if self.rank.steps == before:
            wake.wait(self.idle_wait_s)


def build_dep_engine(model_dir: str, config: EngineConfig, dep: DEPServeConfig,
                     metrics: ServingMetrics) -> LLMEngine:
    """Join the instance (a rendezvous: returns once every rank is there), load this rank's experts, wrap it."""
    dist_config = dep.dist_config(config.device)
    pdist.init(dist_config)
    lb = ExpertLBConfig(num_redundant=dep.redundant_experts, rebalance_interval_steps=dep.rebalance_interval_steps,
                        imbalance_threshold=dep.imbalance_threshold)
    fraction = None if config.kv_cache_bytes is not None else config.kv_cache_fraction or DEFAULT_KV_FRACTION
    dep_config = DEPConfig(model_dir=model_dir, dtype=config.dtype, num_blocks=None, kv_cache_bytes=config.kv_cache_bytes,
                           kv_cache_fraction=fraction,
                           block_size=config.block_size, lb=lb)
    rank = DEPRank(dist_config, dep_config, registry=metrics.factory.registry)
    runner = DEPRunner(rank, metrics, dep.idle_wait_s)
    return LLMEngine(rank.model, Tokenizer(model_dir), config, metrics, runner=runner)
