"""Dispatch/combine: move each token to the ranks holding its chosen experts and bring the results back.

Rows travel as raw bytes so one exchange carries activations, router weights and slot ids together.
Three interchangeable exchanges implement the same all-to-all: `alltoall` (all_to_all_single; NCCL,
and gloo in recent torch), `p2p` (isend/irecv of only the rows a peer needs) and `allgather`
(every rank gathers every padded send buffer; works on any backend, world-size times the traffic).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from engine.model.moe import Experts

ExchangeKind = Literal["alltoall", "p2p", "allgather"]


class Exchange:
    """All-to-all of 2-D uint8 row blocks; every rank of the group calls each method together."""

    def __init__(self, kind: ExchangeKind, rank: int, world_size: int, device: torch.device) -> None:
        self.kind, self.rank, self.world, self.device = kind, rank, world_size, device
        self.bytes_sent = 0  # bytes this rank sent to other ranks, count exchanges and padding included

    def count_matrix(self, send_counts: list[int]) -> torch.Tensor:
        """[src, dst] rows every rank sends every other, from each rank's own send counts."""
        mine = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
        if self.world == 1:
            return mine.unsqueeze(0).cpu()
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine)
        self.bytes_sent += mine.numel() * mine.element_size() * (self.world - 1)
        return torch.stack(rows).cpu()

    def exchange(self, chunks: list[torch.Tensor], counts: torch.Tensor) -> list[torch.Tensor]:
        """Send chunks[r] ([counts[me, r], width] uint8) to rank r; returns what each rank sent here."""
        width = chunks[self.rank].shape[1]
        if self.world == 1:
            return [chunks[0]]
        if self.kind != "allgather":
            self.bytes_sent += sum(c.numel() for r, c in enumerate(chunks) if r != self.rank)
        recv_counts = counts[:, self.rank].tolist()
        if self.kind == "alltoall":
            out = torch.empty(sum(recv_counts), width, dtype=torch.uint8, device=self.device)
            dist.all_to_all_single(out, torch.cat(chunks), recv_counts, counts[self.rank].tolist())
            return list(out.split(recv_counts))
        if self.kind == "p2p":
            return self._p2p(chunks, recv_counts, width)
        return self._allgather(chunks, counts, width)

    def _p2p(self, chunks: list[torch.Tensor], recv_counts: list[int], width: int) -> list[torch.Tensor]:
        recv = [torch.empty(n, width, dtype=torch.uint8, device=self.device) for n in recv_counts]
        recv[self.rank] = chunks[self.rank]
        ops_ = []
        for peer in range(self.world):
            if peer == self.rank:
                continue
            if chunks[peer].shape[0]:
                ops_.append(dist.P2POp(dist.isend, chunks[peer].contiguous(), peer))
            if recv_counts[peer]:
                ops_.append(dist.P2POp(dist.irecv, recv[peer], peer))
        if ops_:
            for work in dist.batch_isend_irecv(ops_):
                work.wait()
        return recv

    def _allgather(self, chunks: list[torch.Tensor], counts: torch.Tensor, width: int) -> list[torch.Tensor]:
        totals = counts.sum(1)
        pad = int(totals.max())
        mine = torch.zeros(pad, width, dtype=torch.uint8, device=self.device)
        if int(totals[self.rank]):
            mine[: int(totals[self.rank])] = torch.cat(chunks)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine)
        self.bytes_sent += mine.numel() * (self.world - 1)
        out = []
        for src in range(self.world):
            start = int(counts[src, : self.rank].sum())
            out.append(everyone[src][start : start + int(counts[src, self.rank])])
        return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[n, d] tensor of any dtype viewed as [n, d * itemsize] uint8 (n may be 0)."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], t.shape[1] * t.element_size())


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b.contiguous().view(dtype)


class ExpertDispatch:
    """The MoE dispatcher of one DEP rank: physical expert p lives on rank p // slots, slot p % slots.

    Each token is sent once to every rank holding at least one of its experts, with its k router
    weights and the k local slot ids there (-1 for experts held elsewhere); that rank's grouped GEMM
    skips the -1 entries, so it returns the token's partial sum, and the origin adds the partials.
    """

    def __init__(self, exchange: Exchange, slots_per_rank: int) -> None:
        self.exchange = exchange
        self.slots = slots_per_rank
        # (token, expert) pairs this rank's experts computed, kept on the device (read back now and then, not per
        # layer): the rank's own load, which the expert LB exists to even out
        self.computed = torch.zeros((), dtype=torch.int64, device=exchange.device)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, physical: torch.Tensor, experts: Experts) -> torch.Tensor:
        ex = self.exchange
        dest, local = physical // self.slots, physical % self.slots
        tokens, chunks = [], []
        for r in range(ex.world):
            on_r = dest == r
            idx = on_r.any(1).nonzero().squeeze(1)
            ids = torch.where(on_r[idx], local[idx], -1).to(torch.int32)
            tokens.append(idx)
            chunks.append(torch.cat((as_bytes(x[idx]), as_bytes(weights[idx].float()), as_bytes(ids)), 1))
        counts = ex.count_matrix([len(t) for t in tokens])
        inbox = torch.cat(ex.exchange(chunks, counts))
        k, hb = weights.shape[1], x.shape[1] * x.element_size()
        rx = from_bytes(inbox[:, :hb], x.dtype)
        rw = from_bytes(inbox[:, hb : hb + 4 * k], torch.float32)
        rid = from_bytes(inbox[:, hb + 4 * k :], torch.int32).long()
        self.computed += (rid >= 0).sum()
        y = experts.run(rx, rw.to(x.dtype), rid)
        replies = list(as_bytes(y).split(counts[:, ex.rank].tolist()))
        back = ex.exchange(replies, counts.t().contiguous())
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for idx, part in zip(tokens, back):
            out.index_add_(0, idx, from_bytes(part, x.dtype).float())
        return out.to(x.dtype)
