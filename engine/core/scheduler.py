"""Continuous batching: which sequences run this step, and how many new tokens each computes.

Every step mixes decode tokens of running sequences with prefill chunks of waiting ones under
one token budget. Running sequences go first (oldest first); when blocks run out the newest
running sequence is preempted by recompute: its blocks are freed and it goes back to the front
of the queue, keeping its generated tokens, which are recomputed as part of its prompt.
Arrivals reach the queue through the shuttle window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel, Field

from engine.core.kv_cache import BlockAllocator, OutOfBlocks
from engine.core.sequence import Sequence, SeqStatus
from engine.core.shuttle import ShuttleWindow


class PrefixStats(BaseModel):
    """Prefix-cache counters, in full blocks, over every admission (recomputes included)."""

    queried: int = Field(0, description="full blocks looked up")
    hit: int = Field(0, description="looked-up blocks found in the cache")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int

    @property
    def completes(self) -> bool:
        """This step computes the sequence's last token, so its logits give the next token."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


@dataclass
class StepPlan:
    batch: list[ScheduledSeq]
    departed: int  # sequences that left the shuttle for the queue this step
    preempted: int


class Scheduler:
    """Single-threaded: the engine loop is its only caller."""

    def __init__(
        self, allocator: BlockAllocator, max_num_seqs: int, max_batch_tokens: int, max_wait_s: float,
        lone_after_s: float | None = None,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.shuttle = ShuttleWindow(max_wait_s, max_batch_tokens, max_num_seqs, lone_after_s)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest arrival first
        self.prefix_stats = PrefixStats()

    @property
    def num_queued(self) -> int:
        """Requests not yet running: in the shuttle or the queue (preempted ones included)."""
        return len(self.shuttle) + len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or len(self.shuttle))

    def add(self, seq: Sequence, now: float) -> None:
        self.shuttle.board(seq, now)

    def wake_at(self) -> float | None:
        """When an idle engine must look again: the shuttle's closing time."""
        return self.shuttle.closes_at

    def schedule(self, now: float) -> StepPlan:
        departed = 0
        if self.shuttle.due(now):
            arrivals = self.shuttle.depart()
            departed = len(arrivals)
            self.waiting.extend(arrivals)
        budget = self.max_batch_tokens
        batch: list[ScheduledSeq] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            try:
                self.allocator.reserve(seq, seq.num_computed + n)
            except OutOfBlocks:
                self._preempt(self.running[-1])  # newest arrival; the ones before i are in the batch
                preempted += 1
                continue
            batch.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        admitted = False
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            reused = self.allocator.match_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            try:
                self.allocator.reserve(seq, seq.num_computed + n)
            except OutOfBlocks:
                self.allocator.release(seq)
                break
            self.waiting.popleft()
            self._note_admission(seq, reused)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
            admitted = True
        if admitted:
            self.running.sort(key=lambda s: s.arrival)
        return StepPlan(batch, departed, preempted)

    def adopt(self, seq: Sequence) -> None:
        """Run a sequence whose KV is already in its blocks (prefilled by another engine) from the next step."""
        seq.status, seq.admitted = SeqStatus.RUNNING, True
        self.running.append(seq)
        self.running.sort(key=lambda s: s.arrival)

    def advance(self, plan: StepPlan) -> None:
        """Account the computed tokens after the model step; name newly full blocks."""
        for item in plan.batch:
            item.seq.num_computed += item.num_new
            self.allocator.commit(item.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        self.running.remove(seq)
        self.allocator.release(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel a request wherever it is; its blocks are freed. None if it is unknown."""
        seq = self.shuttle.remove(request_id)
        if seq is None:
            seq = next((s for s in self.waiting if s.request_id == request_id), None)
            if seq is not None:
                self.waiting.remove(seq)
        if seq is None:
            seq = next((s for s in self.running if s.request_id == request_id), None)
            if seq is not None:
                self.running.remove(seq)
        if seq is None:
            return None
        self.allocator.release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "abort"
        return seq

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.allocator.release(victim)
        victim.status = SeqStatus.WAITING
        self.waiting.appendleft(victim)

    def _note_admission(self, seq: Sequence, reused: int) -> None:
        bs = self.allocator.block_size
        self.prefix_stats.queried += (seq.num_tokens - 1) // bs
        self.prefix_stats.hit += reused // bs
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_prompt = reused
