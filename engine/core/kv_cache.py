"""Paged KV cache bookkeeping: a ref-counted block allocator with prefix caching and LRU eviction.

A full block is named by a chained hash, hash(previous block's hash, its token ids), so two
sequences with the same prefix name the same blocks and share them. Blocks whose last user left
keep their contents and hash (evictable, LRU order) until a fresh block is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from engine.core import host_memory
from engine.core.block_hash import block_hash, chain_hashes
from engine.core.kv_events import KVEventLog
from engine.model.config import ModelConfig
from engine.model.paged import KVCache, kv_bytes_per_block
from engine.core.sequence import Sequence


class OutOfBlocks(Exception):
    """Not enough free blocks for the tokens asked for; the scheduler preempts and retries."""


class BlockAllocator:
    """Owns block ids [0, num_blocks) and each sequence's block table.

    With `lower` (engine.kvtier.tiered.TieredKV, and `kv_cache` to reach the tensors), a cached block is kept below
    before the pool reuses it, and a prompt's blocks found there are loaded instead of computed.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 lower=None, kv_cache: Callable[[], KVCache] | None = None, events: KVEventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # never-hashed blocks, pop() from the end
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref 0, oldest first
        self.lower = lower if enable_prefix_cache else None
        self.kv_cache = kv_cache
        self.events = events if enable_prefix_cache else None  # device blocks named and dropped, for the router
        self._evicted: list[tuple[int, int]] = []  # (block, hash) taken for reuse, kept below before it is written

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Adopt cached blocks for the longest cached run of full blocks; returns tokens reused.

        The last token is never matched: the step needs at least one new token to give logits.
        """
        assert not seq.block_table, "match_prefix runs on a sequence holding no blocks"
        if not self.enable_prefix_cache:
            return 0
        tokens, bs = seq.tokens, self.block_size
        full = (len(tokens) - 1) // bs
        prev: int | None = None
        for i in range(full):
            h = block_hash(prev, tokens[i * bs : (i + 1) * bs], seq.block_extras.get(i, b""))
            block = self.cached.get(h)
            if block is None:
                if self.lower is not None:
                    self._onboard(seq, [h, *chain_hashes(tokens, bs, seq.block_extras, h, i + 1, full)])
                break
            self._take(block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            prev = h
        seq.num_computed = len(seq.block_table) * bs
        if self.lower is not None:
            self.lower.note_uses(self.kv_cache(), seq.block_hashes, seq.block_table)
        return seq.num_computed

    def adopt_cached(self, seq: Sequence, num_blocks: int) -> bool:
        """Take seq's first `num_blocks` full blocks from the cache, all of them or none (the decode role: the
        prompt's blocks prefill did not send because this worker held them)."""
        assert not seq.block_table, "adopt_cached runs on a sequence holding no blocks"
        if num_blocks == 0:
            return True
        if not self.enable_prefix_cache or num_blocks * self.block_size > seq.num_tokens:
            return False
        hashes = chain_hashes(seq.tokens, self.block_size, seq.block_extras, None, 0, num_blocks)
        blocks = [self.cached.get(h) for h in hashes]
        if None in blocks:
            return False
        for block in blocks:
            self._take(block)
        seq.block_table, seq.block_hashes = blocks, hashes
        return True

    def _onboard(self, seq: Sequence, hashes: list[int]) -> None:
        """Load the run of `hashes` (the prompt's blocks past those cached here) that a lower tier holds."""
        run = []
        for h in hashes:  # a block cached here after a gap stays where it is
            if h in self.cached:
                break
            run.append(h)
        found = self.lower.host_run(run) if run else []
        if not found or len(found) > self.num_free:
            return
        blocks = [self._fresh() for _ in found]
        self._keep_evicted()
        self.lower.onboard(self.kv_cache(), blocks, found)
        for block, h in zip(blocks, run):
            self.cached[h] = block
            self.hash_of[block] = h
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        if self.events is not None:
            self.events.stored("device", run[: len(blocks)])

    def _keep_evicted(self) -> None:
        """Hand the blocks taken for reuse to the lower tiers while their bytes are still there."""
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            self.lower.offload(self.kv_cache(), evicted)

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make seq's block table cover `num_tokens` tokens, or raise OutOfBlocks changing nothing."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return
        if need > self.num_free:
            raise OutOfBlocks(f"need {need} blocks, {self.num_free} free")
        seq.block_table.extend(self._fresh() for _ in range(need))
        self._keep_evicted()

    def commit(self, seq: Sequence) -> None:
        """Name the blocks that became full of computed tokens, so later prompts can reuse them."""
        bs = self.block_size
        full = seq.num_computed // bs
        if len(seq.block_hashes) >= full:
            return
        tokens = seq.tokens
        prev = seq.block_hashes[-1] if seq.block_hashes else None
        first = len(seq.block_hashes)
        named = []
        for i in range(first, full):
            h = block_hash(prev, tokens[i * bs : (i + 1) * bs], seq.block_extras.get(i, b""))
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if self.enable_prefix_cache and h not in self.cached and self.hash_of[block] is None:
                self.cached[h] = block
                self.hash_of[block] = h
                named.append(h)
            prev = h
        if self.events is not None:
            self.events.stored("device", named)
        if self.lower is not None:
            self.lower.note_uses(self.kv_cache(), seq.block_hashes[first:], seq.block_table[first:full])

    def release(self, seq: Sequence) -> None:
        """Drop seq's references; cached blocks stay reusable until evicted."""
        for block in reversed(seq.block_table):
            self._drop(block)
        seq.reset_computed()

    def allocate_blocks(self, n: int) -> list[int]:
        """n fresh blocks outside any sequence (e.g. to import transferred KV); free with free_blocks."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
        blocks = [self._fresh() for _ in range(n)]
        if self.lower is not None:
            self._keep_evicted()
        return blocks

    def free_blocks(self, blocks: list[int]) -> None:
        for block in blocks:
            self._drop(block)

    def _drop(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if self.hash_of[block] is not None:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def _take(self, block: int) -> None:
        if self.ref[block] == 0:
            self.evictable.pop(block, None)
        self.ref[block] += 1

    def _fresh(self) -> int:
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of[block]]
            if self.lower is not None:
                self._evicted.append((block, self.hash_of[block]))
            if self.events is not None:
                self.events.removed("device", [self.hash_of[block]])
            self.hash_of[block] = None
        self.ref[block] = 1
        return block


def kv_nbytes(kv_cache: KVCache, num_blocks: int) -> int:
    """Size of `num_blocks` blocks of every layer's K and V."""
    k = kv_cache[0][0]
    return 2 * len(kv_cache) * num_blocks * k[0].numel() * k.element_size()


def export_into(kv_cache: KVCache, block_ids: list[int], out: memoryview | bytearray) -> None:
    """Copy all layers' K and V for `block_ids` into `out` (layout [layer, K|V, block, ...]) in one pass."""
    k0 = kv_cache[0][0]
    dest = torch.frombuffer(out, dtype=torch.uint8).view(k0.dtype).view(len(kv_cache), 2, len(block_ids), *k0.shape[1:])
    index = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    for layer, (k, v) in enumerate(kv_cache):
        dest[layer, 0].copy_(k.index_select(0, index))
        dest[layer, 1].copy_(v.index_select(0, index))


def export_blocks(kv_cache: KVCache, block_ids: list[int]) -> bytes:
    """All layers' K and V for `block_ids` as one contiguous buffer."""
    buf = bytearray(kv_nbytes(kv_cache, len(block_ids)))
    export_into(kv_cache, block_ids, buf)
    return bytes(buf)


def import_blocks(kv_cache: KVCache, block_ids: list[int], data: bytes | memoryview) -> None:
    """Write an `export_blocks` buffer into `block_ids` (freshly allocated by the receiver).

    A memoryview (a shared-memory segment, say) is read in place, without a copy.
    """
    k0 = kv_cache[0][0]
    shape = (len(kv_cache), 2, len(block_ids), *k0.shape[1:])
    expected = k0.element_size() * torch.Size(shape).numel()
    if len(data) != expected:
        raise ValueError(f"KV buffer holds {len(data)} bytes; {len(block_ids)} blocks of this cache need {expected}")
    buffer = data if isinstance(data, memoryview) and not data.readonly else bytearray(data)
    parts = torch.frombuffer(buffer, dtype=torch.uint8).view(k0.dtype).view(shape).to(k0.device)
    index = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    for (k, v), layer in zip(kv_cache, parts):
        k.index_copy_(0, index, layer[0])
        v.index_copy_(0, index, layer[1])


def available_memory(device: torch.device | str) -> int:
    """Bytes free for the KV cache: free GPU memory on CUDA, available host memory on CPU (under the process's
    cgroup limits: engine.core.host_memory)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_memory.available_bytes()


def num_blocks_for_budget(
    config: ModelConfig, block_size: int, device: torch.device | str,
    kv_cache_bytes: int | None = None, kv_cache_fraction: float | None = None, reserve_bytes: int = 0,
) -> int:
    """Blocks that fit the budget: an absolute byte count, or a fraction of available memory that leaves
    `reserve_bytes` of it free (the decode graphs' memory pool, allocated after the cache)."""
    if (kv_cache_bytes is None) == (kv_cache_fraction is None):
        raise ValueError("give exactly one of kv_cache_bytes and kv_cache_fraction")
    if kv_cache_bytes is not None:
        budget = kv_cache_bytes
    else:
        available = available_memory(device)
        budget = min(int(available * kv_cache_fraction), available - reserve_bytes)
    per_block = kv_bytes_per_block(config, block_size)
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes is below one block ({per_block} bytes)")
    return blocks
