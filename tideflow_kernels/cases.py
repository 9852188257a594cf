"""Fresh random inputs for each op (check shapes with odd sizes, decode-like bench shapes) and
the error metric that compares an implementation's outputs with the reference's."""

from __future__ import annotations

import math

import torch

from tideflow_kernels.tiles import to_tiles

DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
# The reference rounds the expert MLP's intermediates to bf16; compiled ops keep them in fp32.
OP_TOLERANCE = {"moe_experts": {"float32": 1e-4, "bfloat16": 4e-2}}
CHECK_DTYPES = (torch.float32, torch.bfloat16)


def tolerance(op: str, dtype: torch.dtype) -> float:
    return OP_TOLERANCE.get(op, DEFAULT_TOLERANCE)[str(dtype).removeprefix("torch.")]


def rms_norm_args(tokens, hidden, dtype, device, residual=True):
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    r = torch.randn(tokens, hidden, dtype=dtype, device=device) if residual else None
    return (x, w, 1e-6, r)


def rotary_args(tokens, q_heads, kv_heads, dim, dtype, device, max_pos=4096, strided=False):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    ang = torch.arange(max_pos, device=device).float()[:, None] * inv[None, :]
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1)
    pos = torch.randint(0, max_pos, (tokens,), device=device)
    if strided:  # q and k as views of one fused projection, like the model produces
        qkv = torch.randn(tokens, q_heads + 2 * kv_heads, dim, dtype=dtype, device=device)
        return (qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads], pos, cos_sin)
    q = torch.randn(tokens, q_heads, dim, dtype=dtype, device=device)
    k = torch.randn(tokens, kv_heads, dim, dtype=dtype, device=device)
    return (q, k, pos, cos_sin)


def gating_args(tokens, experts, k, dtype, device, renormalize=True):
    return (torch.randn(tokens, experts, device=device).to(dtype), k, renormalize)


def moe_args(tokens, hidden, inter, experts, k, dtype, device, skip_fraction=0.0, tiled=False):
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) / math.sqrt(hidden)).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) / math.sqrt(inter)).to(dtype)
    ids = torch.stack([torch.randperm(experts, device=device)[:k] for _ in range(tokens)])
    if skip_fraction:  # experts owned by another rank arrive as -1
        ids = ids.masked_fill(torch.rand(ids.shape, device=device) < skip_fraction, -1)
    weights = torch.softmax(torch.randn(tokens, k, device=device), dim=-1)
    if tiled:
        return (x, to_tiles(w13), to_tiles(w2), weights, ids, True)
    return (x, w13, w2, weights, ids)


def attention_args(context_lens, q_heads, kv_heads, dim, dtype, device, block_size=16):
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    per_seq = [(n + block_size - 1) // block_size for n in context_lens]
    max_blocks = max(per_seq) + 1  # one spare column: entries past a sequence are ignored
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, device=device)
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32, device=device)
    at = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[at : at + n].to(torch.int32)
        at += n
    shape = (num_blocks, block_size, kv_heads, dim)
    kc = torch.randn(shape, device=device).to(dtype)
    vc = torch.randn(shape, device=device).to(dtype)
    q = torch.randn(len(context_lens), q_heads, dim, device=device).to(dtype)
    return (q, kc, vc, tables, lens, 1.0 / math.sqrt(dim))


def check_cases(op: str, dtype: torch.dtype, device: str) -> list[tuple]:
    """Shapes the build verifies: odd sizes, a single token, views, skipped experts, large expert groups."""
    d = (dtype, device)
    if op == "rms_norm":
        return [rms_norm_args(13, 4099, *d), rms_norm_args(1, 512, *d, residual=False)]
    if op == "rotary_embedding":
        return [rotary_args(13, 8, 2, 128, *d), rotary_args(1, 4, 4, 64, *d, strided=True)]
    if op == "topk_gating":
        return [gating_args(13, 64, 8, *d), gating_args(1, 60, 2, *d, renormalize=False)]
    if op == "moe_experts":
        # register tiles with ragged edges (odd sizes; tiles of 4 and of 8 tokens), expert groups past the tiled
        # path's limit (at::mm), and
        # shapes the AMX tiles take (hidden % 64, inter % 32) with groups of a few tokens, of 16 + a rest and
        # of several chunks of 16 + a rest; and those shapes with the weights tiled (every group on the tiles
        # in bf16 on an AMX host, single tokens included; read through a row-major copy elsewhere)
        return [moe_args(13, 257, 96, 8, 2, *d, skip_fraction=0.2), moe_args(41, 257, 97, 8, 2, *d),
                moe_args(37, 128, 64, 4, 2, *d),
                moe_args(150, 97, 40, 2, 2, *d), moe_args(20, 128, 96, 8, 2, *d, skip_fraction=0.2),
                moe_args(75, 128, 96, 4, 2, *d), moe_args(3, 128, 64, 8, 2, *d, tiled=True),
                moe_args(20, 128, 96, 8, 2, *d, skip_fraction=0.2, tiled=True), moe_args(75, 128, 96, 4, 2, *d, tiled=True)]
    if op == "paged_decode_attention":
        # query groups of 4, 1, 6 (two register tiles of heads), 3 and 2 (tiles of 8 keys, blocks of 16 keys
        # ending in a part tile), over head sizes with and without the register-held value sums (64 and 128; 72)
        return [attention_args([1, 37, 100], 8, 2, 128, *d), attention_args([16], 4, 4, 64, *d),
                attention_args([5, 33], 12, 2, 72, *d), attention_args([7, 40], 6, 2, 64, *d),
                attention_args([3, 45, 190], 8, 4, 64, *d)]
    raise KeyError(op)


def bench_case(op: str, dtype: torch.dtype, device: str, tokens: int = 4, hidden: int = 4096) -> tuple:
    """A decode-like call: a few tokens, model-sized hidden."""
    d = (dtype, device)
    heads = max(hidden // 128, 1)
    if op == "rms_norm":
        return rms_norm_args(tokens, hidden, *d)
    if op == "rotary_embedding":
        return rotary_args(tokens, heads, max(heads // 4, 1), 128, *d, strided=True)
    if op == "topk_gating":
        return gating_args(tokens, 64, 8, *d)
    if op == "moe_experts":
        return moe_args(tokens, hidden, hidden // 4, 16, 2, *d)
    if op == "paged_decode_attention":
        return attention_args([512] * tokens, heads, max(heads // 4, 1), 128, *d)
    raise KeyError(op)


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _gating_error(args: tuple, out, ref) -> float:
    """Weights must match; ids may differ from the reference only among tied experts, so they
    are checked by the reference probability they pick (and must be distinct per token)."""
    logits, k = args[0], args[1]
    ids = out[1].long()
    if ids.shape != ref[1].shape:
        return math.inf
    sorted_ids = ids.sort(dim=-1).values
    if (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any():
        return 1.0
    probs = torch.softmax(logits.float(), dim=-1)
    picked = probs.gather(1, ids).sort(dim=-1, descending=True).values
    best = torch.topk(probs, k, dim=-1).values
    return max(relative_error("weights", out[0], ref[0]), relative_error("ids", picked, best))


def relative_error(op: str, out, ref, args: tuple = ()) -> float:
    """max |out - ref| / max |ref| over every output; 1.0 for a different expert choice."""
    if op == "topk_gating":
        return _gating_error(args, out, ref)
    outs, refs = _flat(out), _flat(ref)
    if len(outs) != len(refs):
        return math.inf
    worst = 0.0
    for o, r in zip(outs, refs):
        if o.shape != r.shape:
            return math.inf
        if not r.is_floating_point():
            if not torch.equal(o.to(r.dtype), r):
                return 1.0
            continue
        diff = (o.float() - r.float()).abs().max().item() if r.numel() else 0.0
        scale = r.float().abs().max().item() if r.numel() else 1.0
        worst = max(worst, diff / max(scale, 1e-12))
    return worst if math.isfinite(worst) else math.inf
