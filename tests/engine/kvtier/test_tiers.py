"""Host memory and disk tiers bound themselves: LRU within their size, expiry by age, a restart keeps the disk."""

from __future__ import annotations

import time

import torch

from engine.kvtier.tiers import DiskTier, HostTier


def test_host_memory_drops_the_least_recently_used_past_its_size():
    host = HostTier(capacity=300, ttl_s=None)
    for key in "abc":
        host.put(key, torch.zeros(100, dtype=torch.uint8))
    assert host.get("a") is not None  # a is now the most recent
    host.put("d", torch.zeros(100, dtype=torch.uint8))
    assert host.get("b") is None and all(host.get(k) is not None for k in "acd")
    assert host.evictions == 1 and host.used_bytes() == 300


def test_host_memory_expires_unused_blocks():
    host = HostTier(capacity=1 << 20, ttl_s=0.05)
    host.put("a", torch.zeros(1, dtype=torch.uint8))
    time.sleep(0.1)
    host.expire(time.monotonic())
    assert host.get("a") is None and host.expirations == 1 and host.used_bytes() == 0


def test_disk_tier_keeps_blocks_across_a_restart_and_evicts_files(tmp_path):
    disk = DiskTier(tmp_path, capacity=250, ttl_s=None)
    disk.put("kv/m/v/s/a", b"a" * 100)
    disk.put("kv/m/v/s/b", b"b" * 100)
    again = DiskTier(tmp_path, capacity=250, ttl_s=None)
    assert again.get("kv/m/v/s/a") == b"a" * 100 and again.used_bytes() == 200
    again.put("kv/m/v/s/c", b"c" * 100)  # b is the least recently used now
    assert not (tmp_path / "kv/m/v/s/b").exists() and again.get("kv/m/v/s/b") is None
    assert again.evictions == 1


def test_disk_tier_expires_files_and_clears_cut_writes(tmp_path):
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "x.tmp.1.2.3").write_bytes(b"half")
    disk = DiskTier(tmp_path, capacity=1 << 20, ttl_s=0.05)
    assert not (tmp_path / "kv" / "x.tmp.1.2.3").exists()
    disk.put("kv/a", b"1")
    time.sleep(0.1)
    disk.expire(time.monotonic())
    assert not (tmp_path / "kv" / "a").exists() and disk.expirations == 1


def test_a_disk_file_removed_behind_its_back_is_a_miss(tmp_path):
    disk = DiskTier(tmp_path, capacity=1 << 20, ttl_s=None)
    disk.put("kv/a", b"1")
    (tmp_path / "kv" / "a").unlink()
    assert disk.has("kv/a") and disk.get("kv/a") is None and not disk.has("kv/a")
