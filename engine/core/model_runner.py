"""Runs one step of the model over a batch of sequences that live in the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.decode_graphs import DecodeGraphs
from engine.runtime.device import to_device
from engine.model.decoder import MoEForCausalLM
from engine.model.paged import AttentionMetadata, allocate_kv_cache


@dataclass
class SeqStep:
    """One sequence's share of a step: `tokens` are new, placed after `start` cached tokens."""

    tokens: list[int]
    start: int
    block_table: list[int]
    embeds: torch.Tensor | None = None  # [len(tokens), hidden] to override token embeddings


class ModelRunner:
    """Owns the model and its KV cache tensors; the block allocator lives with the scheduler.

    With `graphs` (engine.core.decode_graphs), decode steps go through its static buffers (replayed as CUDA graphs
    once `capture_graphs` ran), and the KV cache holds one block more than the allocator hands out: the padded rows'
    scratch block."""

    def __init__(self, model: MoEForCausalLM, num_blocks: int, block_size: int = 16,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.config = model.config
        self.block_size = block_size
        self.device = model.embed.weight.device
        self.graphs = graphs
        self.num_blocks, self.kv_cache = 0, []
        if num_blocks:
            self.allocate(num_blocks)

    def allocate(self, num_blocks: int) -> None:
        """(Re)allocate the KV cache tensors, e.g. when a standby instance is activated. Graphs captured over the
        old cache are dropped: capture_graphs again."""
        scratch = 1 if self.graphs is not None else 0
        self.num_blocks = num_blocks
        self.kv_cache = allocate_kv_cache(self.config, num_blocks + scratch, self.block_size, self.device)
        if self.graphs is not None:
            self.graphs.bind(self.kv_cache, num_blocks)

    def release(self) -> None:
        """Free the KV cache memory (and the graphs captured over it); weights stay loaded."""
        self.kv_cache = []
        self.num_blocks = 0
        if self.graphs is not None:
            self.graphs.bind([], 0)

    def capture_graphs(self) -> float:
        """Capture the decode graphs over the current KV cache (after the warm-up); seconds taken, 0 without."""
        return self.graphs.capture_all() if self.graphs is not None else 0.0

    @torch.inference_mode()
    def step(self, seqs: list[SeqStep]) -> torch.Tensor:
        """Logits [len(seqs), vocab] (fp32) at each sequence's last new token."""
        if not self.kv_cache:
            raise RuntimeError("KV cache is released: activate the instance before running steps")
        if self.graphs is not None and self.graphs.covers(seqs):
            return self.graphs.run(seqs)
        ids, pos = [], []
        for s in seqs:
            ids.extend(s.tokens)
            pos.extend(range(s.start, s.start + len(s.tokens)))
        meta = AttentionMetadata.build(
            [len(s.tokens) for s in seqs], [s.start + len(s.tokens) for s in seqs],
            [s.block_table for s in seqs], self.block_size, self.device,
        )
        input_ids = to_device(ids, torch.int64, self.device)
        inputs_embeds = None
        if any(s.embeds is not None for s in seqs):
            base = self.model.embed(input_ids)
            offset = 0
            for s in seqs:
                if s.embeds is not None:
                    base[offset : offset + len(s.tokens)] = s.embeds.to(base.dtype)
                offset += len(s.tokens)
            inputs_embeds = base
        hidden = self.model(input_ids, to_device(pos, torch.int64, self.device), self.kv_cache, meta, inputs_embeds)
        last = to_device([i - 1 for i in _cumsum([len(s.tokens) for s in seqs])], torch.int64, self.device)
        return self.model.logits(hidden.index_select(0, last))


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
