"""Continuous batching: which sequences run this step, and how many new tokens each computes.

Every step mixes decode tokens of running sequences with prefill chunks of waiting ones under
one token budget. Running sequences go first (oldest first); when blocks run out the newest
running sequence is preempted by recompute: its blocks are freed and it goes back to the front
of the queue, keeping its generated tokens, which are recomputed as part of its prompt.
Arrivals reach the queue through the shuttle window.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel, Field

from engine.core.kv_cache import BlockAllocator, OutOfBlocks
from engine.core.sequence import Sequence, SeqStatus
from engine.core.shuttle import ShuttleWindow
from engine.core.step_cost import StepCost


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


RECENT_S = 5.0  # a client that had work this recently still counts when a step's prefill is shared
MAX_SHARES = 16  # with others about, a client's prefill share of a step is at most 1/16 of it (less with more about)


class _Step:
    """The batch being planned: what is in it, what budget is left, what was preempted."""

    def __init__(self, budget: int, share: int) -> None:
        self.budget = budget
        self.share = share  # most prefill tokens one client may take in this step
        self.prefill: dict[str, int] = {}  # client -> prefill tokens taken in this step
        self.batch: list[ScheduledSeq] = []
        self.chosen: set[Sequence] = set()
        self.evicted: set[Sequence] = set()
        self.victims: set[str] = set()  # clients that lost a sequence to preemption in this step
        self.fresh: set[str] = set()  # clients with nothing running that are admitted in this step
        self.preempted = 0
        self.admitted = False

    def room(self, client: str) -> int:
        """Prefill tokens `client` may still take in this step: none for a client with work running once a client
        with nothing running is in the step (see Scheduler._admit)."""
        if self.fresh and client not in self.fresh:
            return 0
        return min(self.budget, self.share - self.prefill.get(client, 0))

    def take(self, seq: Sequence, n: int, scheduler: "Scheduler") -> None:
        self.batch.append(ScheduledSeq(seq, n))
        self.chosen.add(seq)
        self.budget -= n
        client = scheduler.client_of(seq)
        scheduler.served[client] = scheduler.served.get(client, 0) + n
        if seq.num_uncomputed > 1:  # a prefill chunk (a decode token is 1 of 1)
            self.prefill[client] = self.prefill.get(client, 0) + n

    def drop(self, seq: Sequence, scheduler: "Scheduler") -> None:
        """A preempted sequence leaves the batch and gives its budget (and its client's count) back."""
        self.evicted.add(seq)
        self.preempted += 1
        client = scheduler.client_of(seq)
        self.victims.add(client)
        if seq in self.chosen:
            item = next(i for i in self.batch if i.seq is seq)
            self.batch.remove(item)
            self.chosen.discard(seq)
            self.budget += item.num_new
            scheduler.served[client] -= item.num_new
            if item.num_new > 1 or seq.num_uncomputed > 1:
                self.prefill[client] = max(0, self.prefill.get(client, 0) - item.num_new)


class Scheduler:
    """Single-threaded: the engine loop is its only caller.

    With `fair` (the default), the step's prefill budget, the running slots and the KV blocks are shared between
    clients (Sequence.client) by start-time fair queuing over computed tokens: each client's count of tokens
    computed for it, a newcomer starting at the least count of the clients already active (no credit for time
    away), and the next prefill chunk goes to the client with the least count. One client's 12 prompts of 3,000
    tokens then cost another client's short prompt one step, not the 36,000 tokens queued before it. Within a
    client the order stays first come, first served. Without `fair` every request is one client: plain FCFS.

    A request's priority (SamplingParams.priority, lower first, bounded per API key where keys are checked)
    comes before all that: the most urgent queued request is admitted first, whoever's it is, and blocks are
    taken back from the least urgent first. Equal priorities (by default all are 0) share as above.
    """

    def __init__(
        self, allocator: BlockAllocator, max_num_seqs: int, max_batch_tokens: int, max_wait_s: float,
        lone_after_s: float | None = None, fair: bool = True, cost: StepCost | None = None,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.cost = cost  # None: every step may hold max_batch_tokens
        self.fair = fair
        self.shuttle = ShuttleWindow(max_wait_s, max_batch_tokens, max_num_seqs, lone_after_s)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest arrival first
        self.prefix_stats = PrefixStats()
        self.served: dict[str, int] = {}  # client -> tokens computed for it (virtual time), active clients only
        self.seen: dict[str, float] = {}  # client -> when it last had work (clients of the last RECENT_S)
        self._closed_last = False  # the last step admitted a client with nothing running (others' prefill closed)

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

    def forget_clients(self) -> None:
        """Nobody has been about (after the engine's own warm-up: the first client gets the whole budget, not
        1/MAX_SHARES of it for RECENT_S)."""
        self.seen.clear()
        self.served.clear()

    def client_of(self, seq: Sequence) -> str:
        return seq.client if self.fair else ""

    def schedule(self, now: float) -> StepPlan:
        departed = 0
        if self.shuttle.due(now):
            arrivals = self.shuttle.depart()
            departed = len(arrivals)
            for seq in arrivals:
                seq.departed_at = now
            self.waiting.extend(arrivals)
        self._activate(now)
        # With other clients about (running, queued, or between two of their requests), no client's prefill may take
        # more than 1/MAX_SHARES of a step: a step is the wait of everyone's next token (a 2,048-token chunk is a
        # second on 2 CPU cores), and a client about may send its next request at any moment. Alone, a client
        # has the whole budget.
        share = self.max_batch_tokens if len(self.seen) <= 1 else \
            max(self.max_batch_tokens // max(len(self.seen), MAX_SHARES), 1)
        budget = self.max_batch_tokens
        if self.cost is not None:  # while sequences decode, a step holds what fits its target (engine.core.step_cost)
            budget = self.cost.budget(budget, sum(1 for s in self.running if s.num_uncomputed == 1))
        step = _Step(budget, share)
        # 1. every decoding sequence computes its one token, oldest first (blocks permitting)
        i = 0
        while i < len(self.running) and step.budget > 0:
            seq = self.running[i]
            if seq.num_uncomputed != 1 or seq in step.chosen:
                i += 1
                continue
            try:
                self.allocator.reserve(seq, seq.num_computed + 1)
            except OutOfBlocks:
                self._preempt_for(step)
                i = 0  # running shrank, maybe before i: look again (what is taken already is skipped)
                continue
            step.take(seq, 1, self)
            i += 1
        # 2. prefill chunks, running first within a client, then admissions; the least-served client first
        queues = self._prefill_queues(step)
        while step.budget > 0 and queues:
            client = min(queues, key=lambda c: (queues[c][0].params.priority, self.served.get(c, 0),
                                                queues[c][0].num_uncomputed, queues[c][0].arrival))
            seq = queues[client][0]
            if seq in step.evicted:
                del queues[client]  # preempted while it waited in this step's queue: it goes first, next step
                continue
            elif seq.status is SeqStatus.RUNNING:
                n = min(seq.num_uncomputed, step.room(client))
                if n <= 0:
                    del queues[client]  # its share of this step is spent
                    continue
                try:
                    self.allocator.reserve(seq, seq.num_computed + n)
                except OutOfBlocks:
                    if not step.preempted:
                        self._preempt_for(step)  # filling sequences holding every block would wait on each other
                        continue  # for ever: one gives its blocks back (maybe this one) and the head tries again
                    del queues[client]  # its head cannot run this step: its later requests wait (FCFS)
                    continue
                step.take(seq, n, self)
                queues[client].popleft()
            elif not self._admit(seq, client, step):
                del queues[client]
                continue
            else:
                queues[client].popleft()
            if not queues[client]:
                del queues[client]
        self._closed_last = bool(step.fresh)
        if step.admitted:
            self.running.sort(key=lambda s: s.arrival)
        return StepPlan(step.batch, departed, step.preempted)

    def _admit(self, seq: Sequence, client: str, step: "_Step") -> bool:
        """Move a queued sequence into the running batch with its first chunk; False when it cannot run now."""
        if client in step.victims:
            return False  # what this client lost to preemption this step goes first, next step (FCFS)
        if len(self.running) >= self.max_num_seqs and not self._make_room(seq, client, step):
            return False
        # A client with nothing running waits for its first token: with others about, the rest of this step's
        # prefill is its to wait for, so once it is in, the step carries no more of the others' (their decode
        # tokens still run). Never two such steps in a row: newcomers arriving every step would starve the
        # prompts being filled
        fresh = self.fair and len(self.seen) > 1 and not self._closed_last and \
            not any(self.client_of(s) == client for s in self.running)
        if fresh:
            step.fresh.add(client)
        while True:
            reused = self.allocator.match_prefix(seq)
            n = min(seq.num_uncomputed, step.room(client))
            if n > 0:
                try:
                    self.allocator.reserve(seq, seq.num_computed + n)
                    break
                except OutOfBlocks:
                    pass
            self.allocator.release(seq)
            if n <= 0 or not self._make_room(seq, client, step):
                if fresh:
                    step.fresh.discard(client)  # not in the step after all: the others keep their prefill
                return False
        self.waiting.remove(seq)
        self._note_admission(seq, reused)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        step.admitted = True
        step.take(seq, n, self)
        return True

    def _activate(self, now: float) -> None:
        """Clients with work enter `served` at the least count of those already there; idle ones leave it. `seen`
        keeps the clients of the last RECENT_S, idle ones included: a client between two requests is still about."""
        present = {self.client_of(s) for s in self.running} | {self.client_of(s) for s in self.waiting}
        for client in present:
            self.seen[client] = now
        for client in [c for c, at in self.seen.items() if now - at > RECENT_S]:
            del self.seen[client]
        for client in [c for c in self.served if c not in present]:
            del self.served[client]
        floor = min(self.served.values(), default=0)
        for client in present:
            self.served.setdefault(client, floor)

    def _prefill_queues(self, step: "_Step") -> dict[str, deque[Sequence]]:
        """Per client, what wants a prefill chunk this step: its filling sequences (oldest first), then its queued
        ones (the most urgent priority first, then queue order). The step serves the head of the most urgent
        priority next and, among equals, the least-served client's, ties to the shorter job."""
        queues: dict[str, deque[Sequence]] = {}
        for seq in self.running:
            if seq.num_uncomputed > 1 and seq not in step.chosen:
                queues.setdefault(self.client_of(seq), deque()).append(seq)
        for seq in sorted(self.waiting, key=lambda q: q.params.priority):  # stable: queue order within a priority
            queues.setdefault(self.client_of(seq), deque()).append(seq)
        return queues

    def _make_room(self, seq: Sequence, client: str, step: "_Step") -> bool:
        """A client with nothing running may take the newest sequence of the client running the most (one per step),
        never one more urgent than its own `seq`: without it, a client that filled the slots or the blocks first
        would hold them until its requests end."""
        if not self.fair or step.preempted or any(self.client_of(s) == client for s in self.running):
            return False
        counts = Counter(self.client_of(s) for s in self.running)
        if not counts:
            return False
        greedy, held = counts.most_common(1)[0]
        if held < 2:
            return False  # never take the only request a client runs
        victim = next(s for s in reversed(self.running) if self.client_of(s) == greedy)
        if victim.params.priority < seq.params.priority:
            return False
        step.drop(victim, self)
        self._preempt(victim)
        return True

    def _preempt_for(self, step: "_Step") -> None:
        """Blocks ran out for a running sequence: among the sequences of the least urgent priority, preempt the
        newest of the client holding the most blocks (FCFS: the newest overall), dropping it from this step's batch
        if it was in it."""
        least = max(s.params.priority for s in self.running)
        candidates = [s for s in self.running if s.params.priority == least]
        holders = Counter()
        for s in candidates:
            holders[self.client_of(s)] += len(s.block_table)
        greedy = max(holders, key=lambda c: holders[c])
        victim = next(s for s in reversed(candidates) if self.client_of(s) == greedy)
        step.drop(victim, self)
        self._preempt(victim)

    def next_import(self, prefilled: Iterable[Sequence]) -> Sequence:
        """Which prefilled sequence (decode role) takes blocks for its KV next: the most urgent priority, then
        (fair) the client with the fewest sequences running, then the earliest arrival. The engine imports in this
        order and stops at the first that does not fit, so a big import is not starved by smaller ones; one
        client's flood of imports no longer holds the others' behind it in arrival order."""
        running = Counter(self.client_of(s) for s in self.running) if self.fair else Counter()
        return min(prefilled, key=lambda s: (s.params.priority, running[self.client_of(s)], s.arrival))

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

    def recompute(self, seq: Sequence) -> None:
        """A running sequence whose KV is not (all) in its blocks goes back to the front of the queue and is
        computed again, as a preempted one is (a decode worker's import whose skipped prefix was evicted)."""
        self._preempt(seq)

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
