"""A member's KV event feed: a reader following it by cursor knows exactly what a fresh snapshot says is held, in
the KV cache and the tiers below; a cursor that fell behind, or is of another life, gets a snapshot."""

from __future__ import annotations

import random

from engine.core.engine_config import EngineConfig
from engine.core.kv_events import KVEventLog
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.kvtier.config import KVTierConfig
from engine.model.config import read_config
from engine.model.paged import kv_bytes_per_block
from engine.router.kv_index import KVIndex


def test_a_reader_gets_the_events_after_its_cursor_and_a_snapshot_otherwise():
    log = KVEventLog(capacity=3)
    held = {"device": [1, 2]}
    first = log.page("", 0, lambda: held)
    assert first.reset and first.held == held and first.seq == 0
    log.stored("device", [1])
    log.removed("device", [2])
    page = log.page(first.epoch, first.seq, lambda: held)
    assert not page.reset and [(e.kind, e.hashes) for e in page.events] == [("stored", [1]), ("removed", [2])]
    assert log.page(first.epoch, page.seq, lambda: held).events == []
    for h in range(10, 15):  # five more: the first two and the cursor's successor fall out of the log
        log.stored("host", [h])
    assert log.page(first.epoch, page.seq, lambda: held).reset
    assert log.page("another-life", log.page(first.epoch, 0, lambda: held).seq, lambda: held).reset
    log.renew()
    assert log.page(first.epoch, 0, lambda: held).reset


def test_the_feed_followed_by_cursor_matches_a_snapshot_after_evictions(tiny_model_dir, tmp_path):
    block = kv_bytes_per_block(read_config(tiny_model_dir, None), 16)
    config = EngineConfig(kv_cache_bytes=block * 24, block_size=16, version="v1",
                          kv_tiers=KVTierConfig(host_bytes=80 << 10, disk_path=str(tmp_path / "kv")))
    engine = LLMEngine.from_dir(tiny_model_dir, config)
    engine.start()
    try:
        followed, url = KVIndex(), "member"
        rng = random.Random(3)
        system = [rng.randrange(3, 500) for _ in range(96)]
        for round_ in range(3):
            for i in range(5):
                prompt = system + [rng.randrange(3, 500) for _ in range(64 + 16 * i)]
                engine.generate([prompt], SamplingParams(max_tokens=4))
                epoch, after = followed.cursor(url)
                followed.apply(url, engine.kv_event_page(epoch, after).model_dump())
        engine.kv_tiers.close()  # the writer's last blocks are on disk, and their events in the log
        epoch, after = followed.cursor(url)
        followed.apply(url, engine.kv_event_page(epoch, after).model_dump())
        snapshot = KVIndex()
        snapshot.apply(url, engine.kv_event_page("", 0).model_dump())
        got, want = followed.tiers(url), snapshot.tiers(url)
        for tier in ("device", "host", "disk"):
            assert got.get(tier, set()) == want.get(tier, set()), tier
        assert want["device"] and want["host"] and want["disk"]  # each tier held something: the check had teeth
    finally:
        engine.stop()
