"""One engine's KV tiers: blocks evicted from the device pool go down, a prompt's blocks found below come back up.

Threads and their jobs:
- the engine thread copies each evicted block to host memory before the pool reuses it (offload), and writes a
  prompt's blocks found in host memory into fresh pool blocks instead of computing them (onboard);
- a writer thread passes offloaded blocks on to disk and the store through a bounded queue: when it is full the
  write is skipped and counted, the engine never waits on it;
- fetch threads bring a new prompt's blocks up from disk and the store into host memory while the request waits
  at most what its prefill would cost (engine.core.llm_engine parks it).
Blocks in host memory are tensors as exported; on their way to disk or the store they become records with a checksum
(on the writer thread, off the engine's), and every record read back is checked (engine.kvtier.keys.decode): one
that is corrupt, missing or unreachable is recomputed, counted and logged, and never read into the cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from engine.kvtier.block_copy import as_bytes, export_each, from_bytes, import_each
from engine.runtime.errors import TideflowError
from engine.kvtier.config import KVTierConfig
from engine.kvtier.keys import CorruptBlock, KVNamespace, decode, encode
from engine.kvtier.metrics import TierMetrics
from engine.kvtier.tiers import BlockTier, DiskTier, HostTier, StoreTier, TierUnavailable
from engine.telemetry.metrics import MetricFactory
from engine.model.paged import KVCache
from engine.weights.errors import WeightsError
from engine.weights.manifest import MANIFEST_NAME

log = logging.getLogger(__name__)

FETCH_THREADS = 2  # prompts fetched at once
STORE_READS = 8  # one prompt's blocks read from the store at once
USES_KEPT = 1 << 18  # block hashes whose use count is remembered (the admission filter), oldest dropped first
STORED_KEPT = 1 << 18  # keys this member knows the store holds
EXPIRE_EVERY_S = 5.0
PROBE_READS = 3  # the load cost is the fastest of these reads: one read alone may meet a busy moment


class KVTierError(TideflowError):
    """A tier cannot be used as configured (a directory that is not writable, a store that does not answer)."""


class TieredKV:
    def __init__(self, config: KVTierConfig, namespace: KVNamespace, block_size: int, dtype: torch.dtype,
                 block_shape: tuple[int, ...], metrics: TierMetrics | None = None) -> None:
        """`block_shape`: one block as export_each makes it, [layers, 2, block_size, kv heads, head dim]."""
        self.config, self.ns = config, namespace
        self.block_size, self.dtype, self.block_shape = block_size, dtype, block_shape
        self.block_bytes = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.metrics = metrics if metrics is not None else TierMetrics(MetricFactory())
        self.host = HostTier(config.host_bytes, config.host_ttl_s)
        self.disk = DiskTier(_writable(Path(config.disk_path)), config.disk_bytes, config.disk_ttl_s) \
            if config.disk_path else None
        self.store = _open_store(config) if config.store_url else None
        self.lower: list[BlockTier] = [t for t in (self.disk, self.store) if t is not None]
        self.metrics.show([tier.name for tier in [self.host, *self.lower]])
        self.read_cost = {tier.name: self._probe(tier) for tier in [self.host, *self.lower]}
        for name, cost in self.read_cost.items():
            self.metrics.read_cost.labels(name).set(cost)
        self.metrics.capacity.labels("host").set(config.host_bytes)
        if self.disk is not None:
            self.metrics.capacity.labels("disk").set(config.disk_bytes)
        self.events = None  # engine.core.kv_events.KVEventLog: what is stored and removed, per tier, for the router
        self._uses: OrderedDict[int, int] = OrderedDict()  # engine thread only
        self._stored: OrderedDict[str, float] = OrderedDict()  # key -> when this member last wrote or read it there
        self._stored_lock = threading.Lock()
        self._seen_drops: dict[tuple[str, str], int] = {}
        self._writes: queue.Queue = queue.Queue(config.queue_blocks)
        self._fetchers = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="tideflow-kv-fetch")
        self._store_reads = ThreadPoolExecutor(STORE_READS, thread_name_prefix="tideflow-kv-store")
        self._writer = threading.Thread(target=self._write_loop, name="tideflow-kv-offload", daemon=True)
        self._writer.start()
        log.info("KV tiers %s under %s; load cost per block: %s", [t.name for t in [self.host, *self.lower]],
                 namespace.prefix, {k: f"{v * 1e3:.2f} ms" for k, v in self.read_cost.items()})

    # ---- startup ------------------------------------------------------------------------------------------------
    def _probe(self, tier: BlockTier) -> float:
        """Write, read back and drop one block-sized record: a tier that cannot is refused at startup, with what to
        fix; the read's time is the tier's load cost per block (the cost model onboarding consults)."""
        key = f"{self.ns.prefix}probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        block = from_bytes(os.urandom(self.block_bytes), self.dtype, self.block_shape)
        try:
            tier.put(key, block if tier is self.host else encode(key, as_bytes(block)))
            cost = min(self._read_back(tier, key) for _ in range(PROBE_READS))
            tier.drop(key)
        except (TierUnavailable, CorruptBlock, OSError) as exc:
            where = {"disk": f"kv_tiers.disk_path {self.config.disk_path}",
                     "store": f"kv_tiers.store_url {self.config.store_url}"}.get(tier.name, "kv_tiers.host_bytes")
            raise KVTierError(f"{where}: unusable at startup: {exc}") from None
        return cost

    def _read_back(self, tier: BlockTier, key: str) -> float:
        start = time.perf_counter()
        back = tier.get(key)
        if back is None:
            raise TierUnavailable("a block written was not there to read")
        if tier is not self.host:
            from_bytes(decode(key, back, self.block_bytes), self.dtype, self.block_shape)
        return time.perf_counter() - start

    # ---- engine thread ------------------------------------------------------------------------------------------
    def note_uses(self, kv_cache: KVCache, hashes: list[int], blocks: list[int]) -> None:
        """Count a request's use of these blocks (computed or reused). A block whose count reaches a lower tier's
        admission (disk_min_uses, store_min_uses) is written there now, while it is in use: a block hot enough to
        stay in the pool would otherwise never reach the store the other members read."""
        uses, due = self._uses, []
        for h, block in zip(hashes, blocks):
            count = uses[h] = uses.get(h, 0) + 1
            uses.move_to_end(h)
            if any(count == self._min_uses(t) for t in self.lower):
                due.append((block, h))
        while len(uses) > USES_KEPT:
            uses.popitem(last=False)
        if due:
            self._write_through(kv_cache, due)

    def offload(self, kv_cache: KVCache, evicted: list[tuple[int, int]]) -> None:
        """Keep blocks the pool is about to reuse (block id, block hash): copied to host memory now, queued for disk
        and the store when they were used often enough and are not there yet."""
        keys = [self.ns.key(h) for _, h in evicted]
        fresh = [(block, key) for (block, _), key in zip(evicted, keys) if not self.host.has(key)]
        if fresh:
            start = time.perf_counter()
            blocks = export_each(kv_cache, [block for block, _ in fresh])
            for (_, key), block in zip(fresh, blocks):
                self._put_host(key, block)
            self.metrics.offloaded.labels("host").inc(len(fresh))
            self.metrics.offload_seconds.labels("host").observe((time.perf_counter() - start) / len(fresh))
        for (_, h), key in zip(evicted, keys):
            targets = self._targets(h, key)
            block = self.host.get(key) if targets else None
            if block is not None:
                self._queue(key, block, targets)

    def _write_through(self, kv_cache: KVCache, blocks: list[tuple[int, int]]) -> None:
        wanted = [(block, key, targets) for block, h in blocks
                  if (targets := self._targets(h, key := self.ns.key(h)))]
        if not wanted:
            return
        for (_, key, targets), block in zip(wanted, export_each(kv_cache, [block for block, _, _ in wanted])):
            self._queue(key, block, targets)

    def _targets(self, h: int, key: str) -> list[BlockTier]:
        """The lower tiers that admit the block (used often enough) and do not hold it yet."""
        uses = self._uses.get(h, 1)
        return [t for t in self.lower if uses >= self._min_uses(t) and not self._holds(t, key)]

    def _queue(self, key: str, block: torch.Tensor, targets: list[BlockTier]) -> None:
        try:
            self._writes.put_nowait((key, block, targets))
        except queue.Full:
            for tier in targets:
                self.metrics.offload_skipped.labels(tier.name).inc()

    def host_run(self, hashes: list[int]) -> list[torch.Tensor]:
        """The blocks of the leading run of `hashes` that host memory holds."""
        found: list[torch.Tensor] = []
        for h in hashes:
            block = self.host.get(self.ns.key(h))
            if block is None:
                break
            found.append(block)
        self.metrics.queried.labels("host").inc(len(hashes) * self.block_size)
        self.metrics.hit.labels("host").inc(len(found) * self.block_size)
        return found

    def onboard(self, kv_cache: KVCache, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        import_each(kv_cache, block_ids, blocks)
        self.metrics.onboarded.labels("host").inc(len(block_ids))
        self.metrics.onboard_seconds.labels("host").observe(time.perf_counter() - start)

    def worth_loading(self, tier: str, s_per_token: float | None) -> bool:
        """Whether loading a block from `tier` beats computing it, at the engine's measured prefill cost per token
        (unknown before the first long step: loading is assumed to win)."""
        return s_per_token is None or self.read_cost[tier] < s_per_token * self.block_size

    def prefetch(self, hashes: list[int], s_per_token: float | None,
                 done: Callable[[], None]) -> Future | None:
        """Bring the leading run of `hashes` held on disk or in the store up to host memory, in the background; None
        when no tier below host memory is worth reading. `done` runs when the fetch ends, however it ends."""
        tiers = [t for t in self.lower if self.worth_loading(t.name, s_per_token)]
        if not tiers or not hashes:
            return None
        future = self._fetchers.submit(self._fetch, list(hashes), tiers)
        future.add_done_callback(lambda _: done())
        return future

    def has_lower(self) -> bool:
        return bool(self.lower)

    def held_in_host(self, h: int) -> bool:
        return self.host.has(self.ns.key(h))

    def close(self) -> None:
        """Stop the writer after what is queued, and the fetches; a fetch in flight finishes on its own."""
        try:
            self._writes.put(None, timeout=self.config.store_timeout_s)
        except queue.Full:
            pass
        self._writer.join(timeout=2 * self.config.store_timeout_s + 5)
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        self._store_reads.shutdown(wait=False, cancel_futures=True)

    # ---- fetch threads ------------------------------------------------------------------------------------------
    def _fetch(self, hashes: list[int], tiers: list[BlockTier]) -> int:
        """Blocks brought up to host memory: each tier continues the run where the one above it stopped."""
        remaining, brought = [h for h in hashes], 0
        while remaining and self.host.has(self.ns.key(remaining[0])):
            remaining.pop(0)
        # a run longer than host memory holds would evict its own head before the engine reads it
        remaining = remaining[: self.config.host_bytes // self.block_bytes]
        for tier in tiers:
            if not remaining:
                break
            start = time.perf_counter()
            records = self._read_run(tier, [self.ns.key(h) for h in remaining])
            for key, block in records:
                self._put_host(key, block)
            self.metrics.queried.labels(tier.name).inc(len(remaining) * self.block_size)
            if records:
                self.metrics.hit.labels(tier.name).inc(len(records) * self.block_size)
                self.metrics.onboarded.labels(tier.name).inc(len(records))
                self.metrics.onboard_seconds.labels(tier.name).observe(time.perf_counter() - start)
            brought += len(records)
            remaining = remaining[len(records):]
        return brought

    def _read_run(self, tier: BlockTier, keys: list[str]) -> list[tuple[str, torch.Tensor]]:
        """The checked blocks of the leading run of `keys` that `tier` holds."""
        if tier is self.store:
            reads = self._store_reads.map(lambda k: self._read_one(tier, k), keys)
        else:
            reads = (self._read_one(tier, k) for k in keys)
        run = []
        for key, record in zip(keys, reads):
            if record is None:
                break
            run.append((key, record))
        return run

    def _read_one(self, tier: BlockTier, key: str) -> torch.Tensor | None:
        indexed = tier.has(key)
        if indexed is False:
            return None
        try:
            record = tier.get(key)
        except TierUnavailable as exc:
            self.metrics.fallbacks.labels(tier.name, "unavailable").inc()
            log.warning("KV tier %s did not answer; recomputing: %s", tier.name, exc)
            return None
        if record is None:
            if indexed:
                self.metrics.fallbacks.labels(tier.name, "missing").inc()
            return None
        try:
            block = from_bytes(decode(key, record, self.block_bytes), self.dtype, self.block_shape)
        except CorruptBlock as exc:
            self._distrust(tier, key, exc)
            return None
        if tier is self.store:
            self._remember_stored(key)
        return block

    def _distrust(self, tier: BlockTier, key: str, exc: CorruptBlock) -> None:
        self.metrics.fallbacks.labels(tier.name, "corrupt").inc()
        log.warning("KV tier %s holds a corrupt block; dropped and recomputed: %s", tier.name, exc)
        try:
            tier.drop(key)
        except TierUnavailable:
            pass  # the next read checks it again
        self._emit("removed", tier.name, [key])

    # ---- writer thread ------------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        expire_at = time.monotonic() + EXPIRE_EVERY_S
        while True:
            try:
                item = self._writes.get(timeout=EXPIRE_EVERY_S)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                self._write(*item)
            if time.monotonic() >= expire_at:
                for tier in [self.host, *self.lower]:
                    self._emit("removed", tier.name, tier.expire(time.monotonic()))
                expire_at = time.monotonic() + EXPIRE_EVERY_S
            self._report()

    def _write(self, key: str, block: torch.Tensor, targets: list[BlockTier]) -> None:
        record = encode(key, as_bytes(block))
        for tier in targets:
            start = time.perf_counter()
            try:
                dropped = tier.put(key, record)
            except (TierUnavailable, OSError) as exc:
                self.metrics.write_errors.labels(tier.name).inc()
                log.warning("KV tier %s refused a block: %s", tier.name, exc)
                continue
            self.metrics.offloaded.labels(tier.name).inc()
            self.metrics.offload_seconds.labels(tier.name).observe(time.perf_counter() - start)
            self._emit("stored", tier.name, [key])
            self._emit("removed", tier.name, dropped)
            if tier is self.store:
                self._remember_stored(key)

    def _report(self) -> None:
        """Gauges and drop counters follow the tiers' own tallies."""
        for tier in [self.host, *self.lower]:
            used = tier.used_bytes()
            if used is not None:
                self.metrics.used.labels(tier.name).set(used)
            for what, counter in (("evictions", self.metrics.evictions), ("expirations", self.metrics.expirations)):
                now = getattr(tier, what)
                seen = self._seen_drops.get((tier.name, what), 0)
                if now > seen:
                    counter.labels(tier.name).inc(now - seen)
                    self._seen_drops[(tier.name, what)] = now

    # ---- shared -------------------------------------------------------------------------------------------------
    def held(self) -> dict[str, list[int]]:
        """Block hashes each tier holds now (the store: those this member wrote or read there)."""
        with self._stored_lock:
            stored = list(self._stored)
        held = {"host": self._hashes(self.host.keys()), "store": self._hashes(stored)}
        if self.disk is not None:
            held["disk"] = self._hashes(self.disk.keys())
        return held

    def _put_host(self, key: str, block: torch.Tensor) -> None:
        dropped = self.host.put(key, block)
        self._emit("stored", "host", [key])
        self._emit("removed", "host", dropped)

    def _emit(self, kind: str, tier: str, keys: list[str]) -> None:
        if self.events is not None and keys:
            hashes = self._hashes(keys)
            (self.events.stored if kind == "stored" else self.events.removed)(tier, hashes)

    def _hashes(self, keys: list[str]) -> list[int]:
        """The block hashes of this namespace's keys (a probe's key is none)."""
        prefix = self.ns.prefix
        return [int(k[len(prefix):], 16) for k in keys if k.startswith(prefix) and "probe" not in k]

    def _min_uses(self, tier: BlockTier) -> int:
        return self.config.disk_min_uses if tier is self.disk else self.config.store_min_uses

    def _holds(self, tier: BlockTier, key: str) -> bool:
        if tier is self.store:  # seen there within half its TTL: the object may have expired since
            with self._stored_lock:
                seen = self._stored.get(key)
            return seen is not None and time.monotonic() - seen < self.config.store_ttl_s / 2
        return bool(tier.has(key))

    def _remember_stored(self, key: str) -> None:
        with self._stored_lock:
            self._stored[key] = time.monotonic()
            self._stored.move_to_end(key)
            while len(self._stored) > STORED_KEPT:
                self._stored.popitem(last=False)


def _open_store(config: KVTierConfig) -> StoreTier:
    try:
        return StoreTier.open(config.store_url, config.store_timeout_s)
    except WeightsError as exc:  # a URL of no store kind, a bucket name S3 refuses
        raise KVTierError(f"kv_tiers.store_url {config.store_url}: {exc}") from None


def _writable(path: Path) -> Path:
    """`path` created if need be; KVTierError naming it when it is not a writable directory."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        raise KVTierError(f"kv_tiers.disk_path {path}: not a writable directory: {exc}") from None
    return path


def open_tiers(config: KVTierConfig, model_dir: str | Path, model_name: str, version: str, model_config,
               block_size: int, metrics: TierMetrics) -> TieredKV:
    """The tiers of an engine serving `model_dir`, its blocks named for this model, version, dtype and layout."""
    namespace = KVNamespace.of(
        model_name, version, dtype=str(model_config.torch_dtype), block_size=block_size,
        layout=(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim),
        weights_id=weights_identity(Path(model_dir)))
    shape = (model_config.num_layers, 2, block_size, model_config.num_kv_heads, model_config.head_dim)
    return TieredKV(config, namespace, block_size, model_config.torch_dtype, shape, metrics)


def weights_identity(model_dir: Path) -> str:
    """What names these weights apart from others of the same name and version: the manifest of a published version
    (its checksums), else each weights file's name, size and write time. Two members whose identities differ never
    read each other's blocks, even when nobody told them a version."""
    h = hashlib.blake2b(digest_size=12)
    manifest = model_dir / MANIFEST_NAME
    if manifest.is_file():
        h.update(manifest.read_bytes())
        return h.hexdigest()
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.suffix in (".safetensors", ".bin", ".json"):
            st = path.stat()
            h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
