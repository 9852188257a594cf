"""Block allocator: ref counts, prefix sharing by chained hashes, LRU eviction, export/import."""

from __future__ import annotations

import pytest
import torch

from engine.offline.default_model import TINY_CONFIG
from engine.core.block_hash import block_hash
from engine.core.kv_cache import BlockAllocator, OutOfBlocks, export_blocks, import_blocks, num_blocks_for_budget
from engine.model.paged import allocate_kv_cache, kv_bytes_per_block
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def fill(alloc: BlockAllocator, s: Sequence) -> None:
    """What the scheduler does for a whole prompt: match, reserve, compute, commit."""
    alloc.match_prefix(s)
    alloc.reserve(s, s.num_tokens)
    s.num_computed = s.num_tokens
    alloc.commit(s)


def test_chained_hash_depends_on_the_whole_prefix():
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, [1, 2, 3, 4])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(block_hash(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert block_hash(None, [1, 2, 3, 4]) != block_hash(None, [1, 2, 3, 5])


def test_shared_prefix_reuses_blocks_and_counts_references():
    alloc = BlockAllocator(16, 4)
    a = seq(list(range(10)), "a")
    fill(alloc, a)
    assert len(a.block_table) == 3 and alloc.num_used == 3
    b = seq(list(range(8)) + [99, 98, 97], "b")
    assert alloc.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [alloc.ref[x] for x in a.block_table] == [2, 2, 1]
    alloc.reserve(b, b.num_tokens)
    assert alloc.num_used == 4
    alloc.release(a)
    assert [alloc.ref[x] for x in b.block_table[:2]] == [1, 1] and alloc.num_used == 3


def test_the_last_token_is_never_served_from_the_cache():
    alloc = BlockAllocator(8, 4)
    fill(alloc, seq(list(range(8)), "a"))
    assert alloc.match_prefix(seq(list(range(8)), "b")) == 4


def test_released_blocks_stay_cached_until_evicted_least_recently_used_first():
    alloc = BlockAllocator(4, 4)
    first, second = seq(list(range(5)), "1"), seq(list(range(100, 105)), "2")
    fill(alloc, first)
    fill(alloc, second)
    alloc.release(first)
    alloc.release(second)
    assert alloc.num_free == 4 and len(alloc.cached) == 2
    hog = seq(list(range(200, 211)), "hog")  # 3 blocks: 2 never-hashed + the oldest cached one
    alloc.reserve(hog, hog.num_tokens)
    assert alloc.match_prefix(seq(list(range(100, 105)), "again")) == 4  # the newer cached block survived
    assert alloc.match_prefix(seq(list(range(5)), "gone")) == 0


def test_reserve_fails_without_changing_anything():
    alloc = BlockAllocator(2, 4)
    s = seq(list(range(12)))
    with pytest.raises(OutOfBlocks):
        alloc.reserve(s, 12)
    assert s.block_table == [] and alloc.num_free == 2


def test_export_import_round_trip_between_caches():
    src = allocate_kv_cache(TINY_CONFIG, 6, 4)
    for layer, (k, v) in enumerate(src):
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v) + layer)
    data = export_blocks(src, [4, 1])
    assert isinstance(data, bytes) and len(data) == 2 * kv_bytes_per_block(TINY_CONFIG, 4)
    dst = allocate_kv_cache(TINY_CONFIG, 3, 4)
    import_blocks(dst, [0, 2], data)
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(dk[0], sk[4]) and torch.equal(dk[2], sk[1])
        assert torch.equal(dv[0], sv[4]) and torch.equal(dv[2], sv[1])
        assert not dk[1].any()
    with pytest.raises(ValueError, match="need"):
        import_blocks(dst, [0], data)


def test_budget_in_bytes_or_fraction():
    per = kv_bytes_per_block(TINY_CONFIG, 16)
    assert num_blocks_for_budget(TINY_CONFIG, 16, "cpu", kv_cache_bytes=10 * per + 1) == 10
    assert num_blocks_for_budget(TINY_CONFIG, 16, "cpu", kv_cache_fraction=0.01) >= 1
    with pytest.raises(ValueError, match="below one block"):
        num_blocks_for_budget(TINY_CONFIG, 16, "cpu", kv_cache_bytes=per - 1)
    with pytest.raises(ValueError, match="exactly one"):
        num_blocks_for_budget(TINY_CONFIG, 16, "cpu", kv_cache_bytes=per, kv_cache_fraction=0.1)
