"""What attention needs to read and write the paged KV cache for one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.runtime.device import to_device
from engine.model.config import ModelConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AttentionMetadata:
    """Layout of one step's flattened tokens over the sequences of the batch.

    query_lens[i] new tokens of sequence i are in the step; after the step the sequence holds
    context_lens[i] tokens in its blocks (block_tables[i]). slot_mapping[t] is the cache slot
    (block * block_size + offset) where new token t's K/V are written.
    """

    query_lens: list[int]
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    host_context_lens: list[int]  # context_lens on the host: the prefill path reads them without a device sync
    num_decodes: int  # leading sequences with one new token each: they take the paged decode kernel in any batch

    @classmethod
    def build(
        cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        width = max(len(t) for t in block_tables)
        table = torch.zeros(len(block_tables), width, dtype=torch.int32)
        slots: list[int] = []
        for i, (blocks, n, ctx) in enumerate(zip(block_tables, query_lens, context_lens)):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            for pos in range(ctx - n, ctx):
                slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        return cls(
            query_lens=list(query_lens),
            context_lens=to_device(context_lens, torch.int32, device),
            block_tables=table.to(device, non_blocking=True),
            slot_mapping=to_device(slots, torch.int64, device),
            host_context_lens=list(context_lens),
            num_decodes=num_decodes,
        )


def kv_bytes_per_block(config: ModelConfig, block_size: int) -> int:
    """Bytes one block of K and V costs across all layers."""
    elem = torch.empty((), dtype=config.torch_dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str = "cpu"
) -> KVCache:
    """One (K, V) pair per layer, each [num_blocks, block_size, kv_heads, head_dim]."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (torch.zeros(shape, dtype=config.torch_dtype, device=device),
         torch.zeros(shape, dtype=config.torch_dtype, device=device))
        for _ in range(config.num_layers)
    ]
