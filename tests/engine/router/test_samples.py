"""The router's sample log: numbered, bounded, read from a cursor, never silently thinner."""

from engine.router.samples import SampleLog


def fill(log: SampleLog, n: int, groups=("a", "b")) -> None:
    for i in range(n):
        log.add(groups[i % len(groups)], "v1", ok=i % 5 != 0, ttft=0.1 * i, tpot=0.01, e2e=1.0)


def test_a_cursor_reads_each_sample_once_in_order_and_filters_groups():
    log = SampleLog()
    start = log.page(0, None, 0).next
    fill(log, 10)
    first = log.page(start, {"a"}, 3)
    assert [s.seq for s in first.samples] == [1, 3, 5] and first.next == 5
    rest = log.page(first.next, {"a"}, 100)
    assert [s.seq for s in rest.samples] == [7, 9] and rest.next == 10
    assert log.page(rest.next, None, 100).samples == []
    assert [s.ok for s in log.page(0, None, 100).samples][:6] == [False, True, True, True, True, False]


def test_a_full_buffer_says_how_many_it_dropped():
    log = SampleLog(capacity=4)
    fill(log, 10)
    page = log.page(2, None, 100)
    assert page.dropped == 4 and [s.seq for s in page.samples] == [7, 8, 9, 10]
    assert log.page(6, None, 100).dropped == 0


def test_a_cursor_from_before_a_restart_reads_everything_new():
    log = SampleLog()
    fill(log, 3)
    page = log.page(500, None, 100)
    assert [s.seq for s in page.samples] == [1, 2, 3] and page.next == 3
