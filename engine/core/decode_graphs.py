"""Decode steps replayed as CUDA graphs: one graph per batch-size bucket, captured once, fed through static buffers.

A decode step launches a few hundred small kernels; on a GPU the host issuing them, not the device, sets the pace
(one H200: 1.6 ms of device work in a 19 ms step at 32 streams). A captured graph replays every launch of the step in
one call. The graph reads its inputs from fixed addresses, so each step copies its token ids, positions, block
tables, context lengths and cache slots into static buffers, padded to the next bucket (1, 2, 4, ... 256 and
the engine's max_num_seqs). A padded row decodes token 0 at position 0 into a scratch block of the KV cache that no
sequence owns, so it writes nothing a real row reads.

Only steps in which every sequence adds one token take a graph; a prefill, a mixed step, a prompt with spliced
embeddings or a batch above the largest bucket runs eagerly. Without `capture` (a CPU, or tests) `run` does the same
padded forward eagerly: the bucket choice, the padding and the buffers' bookkeeping are the same, only the replay
differs.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from engine.model.decoder import MoEForCausalLM
from engine.model.paged import AttentionMetadata, KVCache, allocate_kv_cache

if TYPE_CHECKING:
    from engine.core.engine_config import EngineConfig
    from engine.core.model_runner import SeqStep

log = logging.getLogger(__name__)

GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graph_batches(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets captured: the standard sizes below the engine's largest batch, and that batch itself."""
    return tuple(sorted({b for b in GRAPH_BATCHES if b < max_num_seqs} | {max_num_seqs}))


def bucket_for(n: int, batches: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `n` sequences; None above the largest."""
    return next((b for b in batches if b >= n), None)


def graph_safe(model: MoEForCausalLM) -> str | None:
    """Why the model's forward cannot be captured, or None. Expert parallelism exchanges tokens with sizes known
    only on the host, and an expert-load observer reads the routing back each step: both need the host mid-step."""
    for moe in model.moe_layers():
        if moe.dispatcher is not None:
            return "experts are dispatched across ranks"
        if moe.load_observer is not None:
            return "expert load is observed each step"
    return None


def decode_graphs_for(model: MoEForCausalLM, config: "EngineConfig") -> "DecodeGraphs | None":
    """Graphs for an engine on a CUDA device, unless `enforce_eager` or the model cannot be captured (logged)."""
    if config.enforce_eager or torch.device(config.device).type != "cuda":
        return None
    why = graph_safe(model)
    if why is not None:
        log.info("CUDA graphs off: %s", why)
        return None
    return DecodeGraphs(model, config.block_size, config.max_num_seqs, capture=True)


class DecodeGraphs:
    """Static decode inputs for every bucket and, with `capture` (CUDA), one graph per bucket over them."""

    def __init__(self, model: MoEForCausalLM, block_size: int, max_num_seqs: int, capture: bool) -> None:
        self.model, self.block_size, self.capture = model, block_size, capture
        self.batches = graph_batches(max_num_seqs)
        self.max_blocks = -(-model.config.context_length // block_size)
        device, largest = model.embed.weight.device, self.batches[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, self.max_blocks, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(largest, dtype=torch.int64, device=device)
        self.kv_cache: KVCache = []
        self.scratch = 0  # the KV cache's block no sequence owns: padded rows write there
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output buffer

    def bind(self, kv_cache: KVCache, scratch_block: int) -> None:
        """A (re)allocated KV cache: graphs captured over the old one would write to freed memory, so they go."""
        self.kv_cache, self.scratch = kv_cache, scratch_block
        self.graphs.clear()
        self.logits.clear()

    def covers(self, seqs: list["SeqStep"]) -> bool:
        """A step of single-token sequences within the buckets, and (with `capture`) graphs to replay: until they
        are captured, or where capture failed, steps run as plain eager ones, unpadded."""
        return (bool(self.kv_cache) and (bool(self.graphs) or not self.capture) and len(seqs) <= self.batches[-1]
                and all(len(s.tokens) == 1 and s.embeds is None and len(s.block_table) <= self.max_blocks
                        for s in seqs))

    @torch.inference_mode()
    def run(self, seqs: list["SeqStep"]) -> torch.Tensor:
        """Logits [len(seqs), vocab] (fp32) of a decode step that `covers` admits."""
        n = len(seqs)
        bucket = bucket_for(n, self.batches)
        self._fill(seqs, bucket)
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)[:n]
        graph.replay()
        return self.logits[bucket][:n].clone()  # the next replay overwrites the buffer

    def _fill(self, seqs: list["SeqStep"], bucket: int) -> None:
        """Copy the step's inputs into the buffers; rows past the batch decode into the scratch block."""
        bs, pad = self.block_size, bucket - len(seqs)
        ids = [s.tokens[0] for s in seqs] + [0] * pad
        positions = [s.start for s in seqs] + [0] * pad
        context = [s.start + 1 for s in seqs] + [1] * pad
        slots = [s.block_table[s.start // bs] * bs + s.start % bs for s in seqs] + [self.scratch * bs] * pad
        table = torch.full((bucket, self.max_blocks), self.scratch, dtype=torch.int32)
        for row, s in enumerate(seqs):
            table[row, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        self.input_ids[:bucket].copy_(torch.tensor(ids, dtype=torch.int64), non_blocking=True)
        self.positions[:bucket].copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=True)
        self.context_lens[:bucket].copy_(torch.tensor(context, dtype=torch.int32), non_blocking=True)
        self.slot_mapping[:bucket].copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)
        self.block_tables[:bucket].copy_(table, non_blocking=True)

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttentionMetadata(query_lens=[1] * bucket, context_lens=self.context_lens[:bucket],
                                 block_tables=self.block_tables[:bucket], slot_mapping=self.slot_mapping[:bucket],
                                 host_context_lens=[1] * bucket,  # read by the prefill path only, never here
                                 num_decodes=bucket)
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_cache, meta)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool; seconds taken. A capture
        that fails (an op that reads back to the host mid-step) leaves every step eager, logged."""
        if not self.capture or not self.kv_cache:
            return 0.0
        t0 = time.perf_counter()
        pool = None
        try:
            for bucket in reversed(self.batches):
                self._fill([], bucket)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # a first run off the capture: lazy init, workspace sizes
                    self._forward(bucket)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[bucket] = self._forward(bucket)
                pool = graph.pool()
                self.graphs[bucket] = graph
            torch.cuda.synchronize()
        except RuntimeError as exc:
            self.graphs.clear()
            self.logits.clear()
            cause = f" (within: {exc.__context__})" if exc.__context__ is not None else ""
            log.warning("CUDA graphs: capture failed, decode runs eagerly: %s%s; an op left on torch's reference "
                        "(which reads sizes back to the host) is the usual cause", exc, cause)
            return 0.0
        took = time.perf_counter() - t0
        log.info("CUDA graphs: captured decode for batch sizes %s in %.2f s", ",".join(map(str, self.batches)), took)
        return took

    def pool_bytes(self) -> int:
        """Device memory the graphs' pool will hold: the peak of one eager forward of the largest bucket over a
        one-block cache (what the KV cache's sizing leaves free for it). 0 off CUDA."""
        if not self.capture:
            return 0
        device, largest = self.input_ids.device, self.batches[-1]
        cache = allocate_kv_cache(self.model.config, 1, self.block_size, device)
        kept = self.kv_cache, self.scratch
        self.kv_cache, self.scratch = cache, 0
        try:
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            with torch.inference_mode():
                self._fill([], largest)
                self._forward(largest)
            torch.cuda.synchronize(device)
            outputs = sum(self.batches) * self.model.config.vocab_size * 4  # every graph keeps its fp32 logits
            return torch.cuda.max_memory_allocated(device) - before + outputs
        finally:
            self.kv_cache, self.scratch = kept
            del cache
            torch.cuda.empty_cache()  # the free memory the KV cache is sized from must not count this as used
