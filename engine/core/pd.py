"""Prefill/decode disaggregation inside one engine: hand a prefilled sequence's KV to a decode worker.

The prefill engine computes the prompt, samples the first token, exports the prompt's KV blocks
into the transport's staging buffer and finishes the sequence (its blocks stay in the prefix
cache): `hand_off`. The decode engine imports those bytes into fresh blocks and continues from the first
token, with the request's seed carried over so seeded sampling is unchanged: `import_prefilled`.

A decode worker that already holds the prompt's first blocks (the router reads which from its KV event feed) is
sent only the rest: prefill skips `skip_blocks`, and decode takes those blocks from its own prefix cache. Where they
were evicted meanwhile, decode recomputes the prompt itself (PrefixGone): slower, never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.kv_cache import BlockAllocator, OutOfBlocks, export_into, import_blocks, kv_nbytes
from engine.model.paged import KVCache
from engine.core.pd_messages import HandoffResult
from engine.core.sampling_params import Logprob
from engine.core.sequence import Sequence
from engine.transfer import KVSender, TransferDescriptor


@dataclass
class Handoff:
    """Attached to a sequence that a decode worker continues."""

    sender: KVSender
    transfer_id: str
    skip_blocks: int = 0  # leading blocks the decode worker holds already: not exported


def export_kv(kv_cache: KVCache, block_ids: list[int], handoff: Handoff) -> TransferDescriptor:
    """Copy the blocks straight into the sender's staging buffer, then seal it."""
    view = handoff.sender.stage(handoff.transfer_id, kv_nbytes(kv_cache, len(block_ids)))
    try:
        export_into(kv_cache, block_ids, view)
    except BaseException:
        view.release()
        handoff.sender.discard(handoff.transfer_id)
        raise
    view.release()
    return handoff.sender.commit(handoff.transfer_id)


class PrefixGone(Exception):
    """The blocks prefill skipped are no longer in this decode worker's cache: the request is recomputed here."""


def hand_off(allocator: BlockAllocator, kv_cache: KVCache, seq: Sequence, first_token: int,
             first_logprob: Logprob | None = None) -> HandoffResult:
    """Prefill role: export the blocks of the prompt (and of a resumed request's tokens) for the decode worker,
    but the leading ones it holds, with what it needs to go on from `first_token` as this engine would have."""
    blocks = seq.block_table[: allocator.blocks_for(seq.num_tokens)]
    skipped = min(seq.handoff.skip_blocks, seq.num_tokens // allocator.block_size, len(blocks) - 1)
    descriptor = export_kv(kv_cache, blocks[skipped:], seq.handoff)
    return HandoffResult(first_token=first_token, descriptor=descriptor, seed=seq.seed,
                         num_cached_tokens=seq.num_cached_prompt, first_logprob=first_logprob, skipped_blocks=skipped)


def import_prefilled(allocator: BlockAllocator, kv_cache: KVCache, seq: Sequence, kv: memoryview,
                     skipped_blocks: int = 0) -> None:
    """Decode role: take the `skipped_blocks` prefill left out from this cache and place the KV bytes of the rest
    into fresh blocks; its tokens count as computed. Raises OutOfBlocks while the cache has too few free blocks, and
    PrefixGone when a skipped block is no longer cached (nothing is taken then)."""
    if skipped_blocks >= allocator.blocks_for(seq.num_tokens):
        raise ValueError(f"{skipped_blocks} blocks skipped of a sequence that fills "
                         f"{allocator.blocks_for(seq.num_tokens)}: at least the last one must be sent")
    if not allocator.adopt_cached(seq, skipped_blocks):
        raise PrefixGone(f"{skipped_blocks} leading blocks were skipped and are no longer all cached here")
    try:
        blocks = allocator.allocate_blocks(allocator.blocks_for(seq.num_tokens) - skipped_blocks)
    except OutOfBlocks:
        allocator.release(seq)
        raise
    try:
        import_blocks(kv_cache, blocks, kv)
    except BaseException:
        allocator.free_blocks(blocks)
        allocator.release(seq)
        raise
    seq.block_table, seq.num_computed = seq.block_table + blocks, seq.num_tokens
    allocator.commit(seq)
