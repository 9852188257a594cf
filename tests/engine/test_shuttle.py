"""Shuttle window: departs when the window closes or when it is full, whichever is first."""

from __future__ import annotations

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.core.shuttle import ShuttleWindow


def seq(n: int, rid: str) -> Sequence:
    return Sequence(rid, list(range(n)), SamplingParams())


def test_departs_when_the_window_closes():
    w = ShuttleWindow(max_wait_s=0.010, max_tokens=1000, max_seqs=10)
    assert not w.due(0.0) and w.closes_at is None
    w.board(seq(5, "a"), now=1.000)
    w.board(seq(5, "b"), now=1.006)
    assert not w.due(1.009) and w.closes_at == 1.010
    assert w.due(1.010)
    assert [s.request_id for s in w.depart()] == ["a", "b"]
    assert len(w) == 0 and w.closes_at is None


def test_departs_early_when_full_of_tokens_or_sequences():
    by_tokens = ShuttleWindow(max_wait_s=1.0, max_tokens=10, max_seqs=10)
    by_tokens.board(seq(6, "a"), 0.0)
    assert not by_tokens.due(0.0)
    by_tokens.board(seq(4, "b"), 0.0)
    assert by_tokens.due(0.0)
    by_seqs = ShuttleWindow(max_wait_s=1.0, max_tokens=10_000, max_seqs=2)
    by_seqs.board(seq(1, "a"), 0.0)
    by_seqs.board(seq(1, "b"), 0.0)
    assert by_seqs.due(0.0)


def test_zero_window_dispatches_at_once():
    w = ShuttleWindow(max_wait_s=0.0, max_tokens=100, max_seqs=8)
    w.board(seq(3, "a"), 5.0)
    assert w.due(5.0)


def test_a_cancelled_passenger_leaves_before_departure():
    w = ShuttleWindow(max_wait_s=1.0, max_tokens=10, max_seqs=8)
    w.board(seq(6, "a"), 0.0)
    w.board(seq(3, "b"), 0.0)
    assert w.remove("a").request_id == "a" and w.remove("zz") is None
    assert w.tokens == 3 and [s.request_id for s in w.passengers] == ["b"]
    w.remove("b")
    assert w.closes_at is None and not w.due(9.0)


def test_a_lone_arrival_departs_at_once_and_arrivals_close_together_gather():
    w = ShuttleWindow(max_wait_s=0.010, max_tokens=1000, max_seqs=10, lone_after_s=0.050)
    w.board(seq(5, "first"), now=1.000)  # nothing came before it
    assert w.due(1.000) and w.closes_at == 1.000
    w.depart()
    w.board(seq(5, "a"), now=1.030)  # 30 ms after the last arrival: companions are likely, the window waits
    w.board(seq(5, "b"), now=1.035)
    assert not w.due(1.039) and w.closes_at == 1.040
    assert [s.request_id for s in w.depart()] == ["a", "b"]
    w.board(seq(5, "late"), now=1.100)  # 65 ms of quiet since "b": alone again
    assert w.due(1.100)


def test_without_the_lone_rule_every_window_waits():
    w = ShuttleWindow(max_wait_s=0.010, max_tokens=1000, max_seqs=10)
    w.board(seq(5, "first"), now=1.000)
    assert not w.due(1.009) and w.closes_at == 1.010
