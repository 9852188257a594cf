"""Replay a fixed schedule of steps on a DEP instance: the harness behind DEP parity tests and benchmarks/ep.py."""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Literal
from unittest import mock

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.parallel.eplb import Placement
from engine.core.model_runner import SeqStep
from engine.parallel.dep import DEPConfig, DEPRank
from engine.parallel.dist import DistConfig


class SeqSpec(BaseModel):
    """One sequence's share of a step (see engine.core.model_runner.SeqStep)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: list[int] = Field(min_length=1, description="new token ids")
    start: int = Field(ge=0, description="tokens of this sequence already in the KV cache")
    block_table: list[int] = Field(min_length=1, description="KV blocks of the sequence")


class ReplayStep(BaseModel):
    """Either a model step (one batch per rank, possibly empty) or a rebalance between steps."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batches: list[list[SeqSpec]] | None = Field(None, description="per-rank batches of this step")
    rebalance: bool = Field(False, description="rebalance experts here (to `placement`, or by the expert LB's plan)")
    placement: Placement | None = Field(None, description="placement to apply when rebalancing")
    fault: Literal["low_memory", "stage_error"] | None = Field(
        None, description="a rebalance that goes wrong on `fault_rank`: it reports no free memory (the move is "
                          "refused), or its staging raises after the exchange (the move fails)")
    fault_rank: int = Field(0, ge=0, description="the rank the fault hits")

    @model_validator(mode="after")
    def _check(self) -> "ReplayStep":
        if (self.batches is None) == (not self.rebalance):
            raise ValueError("a replay step is either batches or rebalance, not both or neither")
        return self


class ReplayJob(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    dep: DEPConfig = Field(description="what each rank loads")
    placement: Placement | None = Field(None, description="initial placement (None: contiguous, no replicas)")
    steps: list[ReplayStep] = Field(description="the schedule, run in order by every rank")
    threads_per_rank: int = Field(1, gt=0, description="torch intra-op threads per rank")


class RankResult(BaseModel):
    """What one rank saw: logits per model step (None for rebalances) and transport figures."""

    logits: list[list[list[float]] | None]
    placements: list[list[list[int]]] = Field(description="phy2log after each rebalance")
    failed_moves: int = Field(0, description="rebalances this rank saw refused or failed")
    step_seconds: float = Field(description="wall time of the model steps")
    step_bytes: int = Field(description="dispatch/combine bytes this rank sent during model steps")
    tokens: int = Field(description="tokens this rank processed")
    routed: int = Field(description="(token, expert) pairs this rank routed within the load window")


def replay_rank(dist_config: DistConfig, job: ReplayJob) -> RankResult:
    """Run `job` as rank dist_config.rank (the process group is already initialised)."""
    torch.set_num_threads(job.threads_per_rank)
    rank = DEPRank(dist_config, job.dep, job.placement)
    logits: list[list[list[float]] | None] = []
    placements: list[list[list[int]]] = []
    seconds, sent, tokens = 0.0, 0, 0
    for step in job.steps:
        if step.rebalance:
            with ExitStack() as faults:
                if step.fault is not None and dist_config.rank == step.fault_rank:
                    faults.enter_context(_fault(rank, step.fault))
                applied = rank.rebalance(step.placement)
            placements.append(applied.phy2log if applied else rank.placement.phy2log)
            logits.append(None)
            continue
        seqs = [SeqStep(s.tokens, s.start, s.block_table) for s in step.batches[dist_config.rank]]
        before = rank.exchange.bytes_sent
        t0 = time.perf_counter()
        out = rank.step(seqs)
        seconds += time.perf_counter() - t0
        sent += rank.exchange.bytes_sent - before
        tokens += sum(len(s.tokens) for s in seqs)
        logits.append(out.cpu().tolist())
    routed = int(rank.stats.window_load().sum())
    return RankResult(logits=logits, placements=placements, step_seconds=seconds, step_bytes=sent, tokens=tokens,
                      routed=routed, failed_moves=rank.failed_moves)


def _fault(rank: DEPRank, kind: str):
    if kind == "low_memory":
        return mock.patch("engine.parallel.dep.available_memory", return_value=0)
    stage = rank._stage_weights

    def fail_after_the_exchange(new):
        stage(new)  # the peers' exchange completes; this rank's staging then fails
        raise MemoryError("injected: staging the new expert weights")

    return mock.patch.object(rank, "_stage_weights", side_effect=fail_after_the_exchange)
