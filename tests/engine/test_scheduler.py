"""Continuous batching, chunked prefill, preemption by recompute, FCFS, cancellation; and the
engine's results under all of it equal the reference `generate` loop token for token."""

from __future__ import annotations

import random
import time

import pytest

from engine.offline.generate import generate
from engine.core.kv_cache import BlockAllocator
from engine.core.llm_engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.model.paged import kv_bytes_per_block
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import MAX_SHARES, Scheduler
from engine.core.sequence import Sequence, SeqStatus
from engine.core.step_cost import MIN_CHUNK, StepCost
from engine.model.tokenizer import Tokenizer


def seq(rid: str, n: int, max_tokens: int = 4, arrival: float = 0.0, first: int = 1) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), arrival=arrival)


def sched(num_blocks: int = 64, budget: int = 64, max_seqs: int = 8, wait_s: float = 0.0) -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks, 4), max_seqs, budget, wait_s)


def step(s: Scheduler, now: float = 0.0) -> dict[str, int]:
    """One engine iteration without a model: every completed sequence 'samples' token 7."""
    plan = s.schedule(now)
    done = [i.seq for i in plan.batch if i.completes]
    s.advance(plan)
    for q in done:
        q.output_tokens.append(7)
        if len(q.output_tokens) == q.params.max_tokens:
            s.finish(q, "length")
    return {i.seq.request_id: i.num_new for i in plan.batch}


def test_sequences_join_and_leave_the_running_batch_every_step():
    s = sched()
    s.add(seq("a", 5, max_tokens=2), 0.0)
    assert step(s) == {"a": 5}
    s.add(seq("b", 3, max_tokens=2), 0.0)
    assert step(s) == {"a": 1, "b": 3}  # a decodes while b prefills, in one step
    assert step(s) == {"b": 1}  # a left after its 2nd token
    assert not s.has_work and s.allocator.num_used == 0


def test_chunked_prefill_respects_the_token_budget():
    s = sched(budget=16)
    s.add(seq("long", 40), 0.0)
    s.add(seq("short", 2), 0.0)
    assert step(s) == {"long": 16}
    assert step(s) == {"long": 16}
    assert step(s) == {"long": 8, "short": 2}
    assert step(s) == {"long": 1, "short": 1}


def test_preemption_frees_the_newest_and_recomputes_its_tokens():
    s = sched(num_blocks=4, budget=64)
    old, new = seq("old", 7, max_tokens=8, arrival=1.0), seq("new", 7, max_tokens=8, arrival=2.0, first=100)
    s.add(old, 0.0)
    s.add(new, 0.0)
    assert step(s) == {"old": 7, "new": 7}  # 2 blocks each: the cache is full
    assert step(s) == {"old": 1, "new": 1}  # position 7 still fits in 2 blocks
    got = step(s)  # both need a 3rd block for position 8: the newest is preempted
    assert got == {"old": 1} and new.status is SeqStatus.WAITING and list(s.waiting) == [new]
    assert new.output_tokens == [7, 7] and new.block_table == [] and new.num_computed == 0
    while new.status is not SeqStatus.RUNNING:
        got = step(s)
    assert old.status is SeqStatus.FINISHED
    # re-admitted: prompt + kept outputs recomputed in one chunk (old's growth evicted its cached blocks)
    assert got == {"new": 7 + 2} and new.output_tokens == [7, 7, 7]  # its logits gave the 3rd token
    while s.has_work:
        step(s)
    assert new.output_tokens == [7] * 8 and s.allocator.num_used == 0


def test_fcfs_a_later_arrival_does_not_jump_a_head_that_does_not_fit():
    s = sched(num_blocks=4, budget=64)
    s.add(seq("a", 12, max_tokens=3), 0.0)
    step(s)
    s.add(seq("big", 8), 0.0)
    s.add(seq("small", 1), 0.0)
    assert step(s) == {"a": 1}  # big needs 2 blocks, 1 is free; small waits behind it
    assert [q.request_id for q in s.waiting] == ["big", "small"]


def test_max_num_seqs_caps_the_running_batch():
    s = sched(max_seqs=2)
    for r in "abc":
        s.add(seq(r, 3), 0.0)
    assert set(step(s)) == {"a", "b"} and len(s.waiting) == 1


def test_the_shuttle_window_holds_arrivals_until_it_closes():
    s = sched(wait_s=0.010)
    s.add(seq("a", 3), 1.000)
    assert step(s, 1.005) == {} and s.wake_at() == pytest.approx(1.010)
    s.add(seq("b", 3), 1.008)
    plan = s.schedule(1.010)
    assert plan.departed == 2 and len(plan.batch) == 2


def test_a_request_that_waited_out_the_window_in_the_inbox_departs_at_the_next_look(tiny):
    """The engine boards a request with its arrival time: one that came while a step ran has waited that
    long already, so the next step takes it (boarded at the look instead, it would miss that step)."""
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(kv_cache_bytes=1 << 20, max_wait_ms=20, lone_arrival_ms=0))  # we step
    engine.submit([5, 6, 7], SamplingParams(max_tokens=1), lambda out: None)
    arrived = engine._adds[0].seq.arrival
    while time.monotonic() < arrived + 0.021:  # the window's time passes while "a step runs"
        time.sleep(0.005)
    engine._drain_inbox()
    plan = engine.scheduler.schedule(time.monotonic())
    assert plan.departed == 1 and [i.seq.prompt_tokens for i in plan.batch] == [[5, 6, 7]]


def test_a_lone_arrival_skips_the_window_and_the_engine_wires_the_rule_from_its_config(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(kv_cache_bytes=1 << 20, max_wait_ms=50))  # lone_arrival_ms: 20
    engine.submit([5, 6, 7], SamplingParams(max_tokens=1), lambda out: None)
    engine._drain_inbox()
    plan = engine.scheduler.schedule(time.monotonic())  # well inside its 50 ms window: it left alone, at once
    assert plan.departed == 1
    quiet = LLMEngine(model, tok, EngineConfig(kv_cache_bytes=1 << 20, max_wait_ms=50, lone_arrival_ms=0))
    quiet.submit([5, 6, 7], SamplingParams(max_tokens=1), lambda out: None)
    quiet._drain_inbox()
    assert quiet.scheduler.schedule(time.monotonic()).departed == 0  # the rule off: it waits its window


def test_cancellation_frees_blocks_wherever_the_request_is():
    s = sched(max_seqs=1, wait_s=1.0)
    s.add(seq("shuttle", 3), 0.0)
    assert s.abort("shuttle").finish_reason == "abort" and s.num_queued == 0
    s = sched(max_seqs=1)
    s.add(seq("run", 9), 0.0)
    s.add(seq("wait", 9), 0.0)
    step(s)
    assert s.allocator.num_used == 3
    assert s.abort("wait") is not None and s.abort("run") is not None
    assert s.allocator.num_used == 0 and not s.has_work and s.abort("run") is None


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), Tokenizer(tiny_model_dir)


def _workload(seed: int, count: int, lo: int, hi: int, max_lo: int, max_hi: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]
    return prompts, [SamplingParams(max_tokens=rng.randrange(max_lo, max_hi)) for _ in prompts]


@pytest.mark.parametrize("config", [
    EngineConfig(kv_cache_bytes=32 << 20, max_batch_tokens=96, max_wait_ms=0),  # chunked prefill mixed with decode
    EngineConfig(kv_cache_bytes=20 * 8192, max_batch_tokens=512, max_wait_ms=3),  # 20 blocks: heavy preemption
], ids=["chunked", "preempting"])
def test_engine_token_ids_equal_generate(tiny, config):
    model, tok = tiny
    assert kv_bytes_per_block(model.config, 16) == 8192
    prompts, params = _workload(4, 16, 3, 200, 4, 48)
    want = generate(model, tok, prompts, params)
    engine = LLMEngine(model, tok, config)
    engine.start()
    try:
        got = engine.generate(prompts, params)
    finally:
        engine.stop()
    assert [g.token_ids for g in got] == [w.tokens for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert engine.allocator.num_used == 0
    if config.kv_cache_bytes < 1 << 20:
        assert engine.metrics.value("tideflow_preemptions_total") > 0


SHARED = 8 * MAX_SHARES  # a step budget whose share, with another client about, is 8 tokens


def client_seq(client: str, rid: str, n: int, max_tokens: int = 4, first: int = 1) -> Sequence:
    q = seq(rid, n, max_tokens=max_tokens, first=first)
    q.client = client
    return q


@pytest.mark.parametrize("fair", [True, False])
def test_a_short_request_of_another_client_runs_next_step_not_after_a_flood(fair):
    """One client's long prompts fill every step's budget; another client's short one used to wait them all out."""
    s = Scheduler(BlockAllocator(1024, 4), 8, SHARED, 0.0, fair=fair)
    for i in range(3):
        s.add(client_seq("flood", f"f{i}", SHARED + 32, first=1000 * i + 1), 0.0)
    assert step(s) == {"f0": SHARED}
    s.add(client_seq("other", "short", 3), 0.0)
    got = step(s)
    if fair:
        # the other client first (it has been served nothing), and the step it waits for carries none of the
        # flood's prefill; after it, with another client about, the flood's prefill takes at most a sixteenth of
        # a step, which keeps the step (everyone's wait for a token) short
        assert got == {"short": 3}
        assert step(s) == {"short": 1, "f0": 8}
    else:
        assert got == {"f0": 32, "f1": SHARED - 32}  # FCFS: behind the flood's queued prompt tokens
        assert "short" not in step(s)


def test_clients_share_the_budget_by_tokens_served_and_a_newcomer_gets_no_credit_for_time_away():
    s = Scheduler(BlockAllocator(1024, 4), 8, SHARED, 0.0)
    s.add(client_seq("a", "a0", 1000, max_tokens=1), 0.0)
    for _ in range(5):
        assert step(s) == {"a0": SHARED}  # alone: it takes every step
    s.add(client_seq("b", "b0", 1000, max_tokens=1, first=2000), 0.0)
    served = {"a": 0, "b": 0}
    for _ in range(6):
        for rid, n in step(s).items():
            served[rid[0]] += n
    # b starts at a's count, not at 0: the two alternate instead of b taking the next 80 tokens alone
    assert served == {"a": 48, "b": 48}


def test_a_client_with_nothing_running_takes_a_slot_from_the_client_holding_them_all():
    s = Scheduler(BlockAllocator(256, 4), 2, 64, 0.0)
    s.add(client_seq("flood", "f0", 3, max_tokens=50), 0.0)
    s.add(client_seq("flood", "f1", 3, max_tokens=50, first=50), 0.0)
    assert step(s) == {"f0": 3, "f1": 3}
    s.add(client_seq("other", "o0", 3, max_tokens=2, first=90), 0.0)
    got = step(s)
    assert got == {"f0": 1, "o0": 3}  # f1, the flood's newest, went back to the queue for a recompute
    assert [q.request_id for q in s.waiting] == ["f1"] and s.waiting[0].output_tokens == [7]


def test_a_client_with_nothing_running_takes_blocks_from_the_client_holding_them():
    s = Scheduler(BlockAllocator(4, 4), 8, 64, 0.0)
    s.add(client_seq("flood", "f0", 7, max_tokens=2), 0.0)
    s.add(client_seq("flood", "f1", 7, max_tokens=2, first=50), 0.0)
    assert step(s) == {"f0": 7, "f1": 7}  # every block taken
    s.add(client_seq("other", "o0", 3, max_tokens=2, first=90), 0.0)
    got = step(s)
    assert got == {"f0": 1, "o0": 3}
    assert [q.request_id for q in s.waiting] == ["f1"]
    for _ in range(20):  # f1 comes back once blocks free up, and everything ends
        if not s.has_work:
            break
        step(s)
    assert not s.has_work and s.allocator.num_used == 0


def test_a_client_s_prefill_share_of_a_step_comes_back_once_the_others_are_gone_for_a_while():
    s = Scheduler(BlockAllocator(256, 4), 8, SHARED, 0.0)
    s.add(client_seq("flood", "f0", 800, max_tokens=1), 0.0)
    s.add(client_seq("other", "o0", 2, max_tokens=1, first=900), 0.0)
    assert step(s, 0.0) == {"o0": 2, "f0": 8}  # both had nothing running: both are in the step
    assert step(s, 1.0) == {"f0": 8}  # o0 ended, but its client was here a second ago
    assert step(s, 10.0) == {"f0": SHARED}  # gone for longer than RECENT_S: the flood has the whole step


def test_two_clients_filling_every_block_do_not_wait_on_each_other_for_ever():
    """Both prompts fill their share of the budget a step until no block is left: one must give its blocks back."""
    s = Scheduler(BlockAllocator(16, 4), 8, SHARED, 0.0)
    s.add(client_seq("a", "a0", 40, max_tokens=2), 0.0)
    s.add(client_seq("b", "b0", 40, max_tokens=2, first=100), 0.0)
    for _ in range(60):
        if not s.has_work:
            break
        step(s)
    assert not s.has_work and s.allocator.num_used == 0


def test_one_client_stays_first_come_first_served_after_a_preemption():
    s = Scheduler(BlockAllocator(4, 4), 8, 64, 0.0)
    s.add(seq("a", 7, max_tokens=3, arrival=1.0), 0.0)
    s.add(seq("b", 7, max_tokens=3, arrival=2.0, first=50), 0.0)
    step(s)
    step(s)
    s.add(seq("d", 3, max_tokens=2, arrival=3.0, first=90), 0.0)
    assert step(s) == {"a": 1}  # b preempted for a's block; d does not pass b, which waits first in line
    assert [q.request_id for q in s.waiting] == ["b", "d"]


def urgent_seq(client: str, rid: str, n: int, priority: int, first: int) -> Sequence:
    q = client_seq(client, rid, n, max_tokens=2, first=first)
    q.params = q.params.model_copy(update={"priority": priority})
    return q


def test_a_more_urgent_request_is_admitted_before_the_least_served_client_s():
    s = Scheduler(BlockAllocator(256, 4), 2, SHARED, 0.0)
    s.add(client_seq("a", "a0", 8, max_tokens=8), 0.0)
    assert step(s) == {"a0": 8}  # a has been served; b has not
    s.add(client_seq("b", "b0", 8, max_tokens=2, first=100), 0.0)
    s.add(urgent_seq("a", "a1", 8, priority=-1, first=200), 0.0)
    got = step(s)
    # one slot was left: a's urgent request takes it although b is the least served, and b, with nothing
    # running, may not take it back (it may take a less urgent one: see the slot test above)
    assert got == {"a0": 1, "a1": 8} and [q.request_id for q in s.waiting] == ["b0"]


def test_within_a_client_the_most_urgent_queued_request_goes_first_and_equal_ones_keep_their_order():
    s = Scheduler(BlockAllocator(256, 4), 8, 4, 0.0, fair=False)
    for rid, priority, first in (("late", 5, 1), ("first", 0, 100), ("second", 0, 200), ("urgent", -3, 300)):
        s.add(urgent_seq("a", rid, 4, priority, first), 0.0)
    order: list[str] = []
    for _ in range(20):
        order += [rid for rid in step(s) if rid not in order]
    assert order == ["urgent", "first", "second", "late"]


def test_blocks_are_taken_back_from_the_least_urgent_sequence_first():
    s = Scheduler(BlockAllocator(4, 4), 8, 64, 0.0, fair=False)
    s.add(urgent_seq("a", "background", 8, priority=10, first=1), 0.0)
    s.add(urgent_seq("a", "normal", 8, priority=0, first=50), 0.0)
    assert step(s) == {"normal": 8, "background": 8}  # every block taken
    got = step(s)  # each needs a block for its next token: the background one gives its blocks back
    assert got == {"normal": 1} and [q.request_id for q in s.waiting] == ["background"]


def test_prefilled_imports_go_to_the_client_running_the_fewest_then_by_arrival():
    s = Scheduler(BlockAllocator(256, 4), 8, SHARED, 0.0)
    for i in range(3):
        s.adopt(client_seq("flood", f"f{i}", 4, first=10 * i + 1))
    waiting = [client_seq("flood", "f3", 4, first=50), client_seq("flood", "f4", 4, first=60),
               client_seq("other", "o0", 4, first=70)]
    for i, q in enumerate(waiting):
        q.arrival = float(i)
    assert s.next_import(waiting).request_id == "o0"  # last to arrive, but its client runs nothing
    waiting[1].params = waiting[1].params.model_copy(update={"priority": -1})
    assert s.next_import(waiting).request_id == "f4"  # more urgent than any
    fcfs = Scheduler(BlockAllocator(256, 4), 8, SHARED, 0.0, fair=False)
    waiting[1].params = waiting[1].params.model_copy(update={"priority": 0})
    assert fcfs.next_import(waiting).request_id == "f3"  # arrival order


def test_a_step_closed_for_a_newcomer_is_never_followed_by_another():
    """Newcomers arriving every step would otherwise hold a prompt being filled at no prefill at all."""
    s = Scheduler(BlockAllocator(1024, 4), 64, SHARED, 0.0)
    s.add(client_seq("long", "l0", 400, max_tokens=2), 0.0)
    assert step(s) == {"l0": SHARED}  # alone: the whole step
    got = []
    for i in range(6):
        s.add(client_seq(f"c{i}", f"n{i}", 2, max_tokens=1, first=1000 + 10 * i), 0.0)
        got.append(step(s).get("l0", 0))
    assert got == [0, 8, 0, 8, 0, 8]


def test_step_cost_is_learned_from_prefill_sized_steps_and_bounds_the_budget_only_while_sequences_decode():
    cost = StepCost(target_s=0.25)
    assert cost.budget(2048, decoding=32) == 2048  # nothing learned yet: the whole budget
    cost.learn(tokens=8, took_s=0.2)  # a few decodes: mostly fixed overhead, teaches nothing
    assert cost.s_per_token is None
    cost.learn(tokens=1000, took_s=0.5)  # 0.5 ms a token
    assert cost.budget(2048, decoding=32) == 500  # 250 ms at 0.5 ms a token
    assert cost.budget(2048, decoding=0) == 2048  # nobody waits on the step
    assert cost.budget(300, decoding=32) == 300  # never more than max_batch_tokens
    assert cost.budget(2048, decoding=480) == 480 + MIN_CHUNK  # every decode, and a prompt still advances
    cost.learn(tokens=1000, took_s=1.5)  # the host got slower (a rebuild loads beside it): the budget follows
    assert cost.s_per_token == pytest.approx(0.8 * 0.0005 + 0.2 * 0.0015)
    assert StepCost(target_s=None).budget(2048, decoding=32) == 2048  # off


def test_while_sequences_decode_a_prompt_is_prefilled_in_steps_that_fit_the_target():
    """Many prompts landing at once on a decoding engine (a failed member's moved requests) no longer make one long
    step that stalls every stream: each step holds the decodes and what else fits the step target."""
    cost = StepCost(target_s=0.01)
    s = Scheduler(BlockAllocator(256, 4), 16, 512, 0.0, cost=cost)
    for i in range(4):
        s.add(seq(f"d{i}", 4, max_tokens=50, first=100 * i + 1), 0.0)
    assert step(s) == {f"d{i}": 4 for i in range(4)}  # nothing decodes yet: the whole budget
    cost.learn(tokens=100, took_s=0.1)  # 1 ms a token: a 10 ms step holds 10 tokens, at least decodes + MIN_CHUNK
    s.add(seq("p", 200, max_tokens=2, first=900), 0.0)
    assert step(s) == {**{f"d{i}": 1 for i in range(4)}, "p": MIN_CHUNK}
    assert step(s) == {**{f"d{i}": 1 for i in range(4)}, "p": MIN_CHUNK}
    cost.target_s = None  # off: the prompt takes what is left of max_batch_tokens at once
    assert step(s) == {**{f"d{i}": 1 for i in range(4)}, "p": 200 - 2 * MIN_CHUNK}
