"""Compiled CPU ops vs their torch eager references on the same decode-like inputs (1-32
tokens, hidden 512-4096; the MoE experts also on the tiled weights the engine keeps where the build reads
them fastest that way, against torch on row-major weights), the MoE experts streamed over 8 layers as
decode streams them (weights out of cache), then decode tokens/s of a small random MoE model with compiled ops
vs `tideflow_kernels.ops.use_reference()`. Prints ratios (reference time / compiled time); the MoE experts also on
torch's grouped GEMM (tideflow_kernels.grouped_moe), with how much faster this build's kernel is.

    python benchmarks/kernel_ops.py [--iters 10] [--dtype bfloat16] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tideflow_kernels import cases, grouped_moe, ops, reference
from tideflow_kernels.build import build
from tideflow_kernels.loader import load_cached
from tideflow_kernels.spec import BuildRequest
from tideflow_kernels.tiles import to_tiles
from tideflow_kernels.timing import compare_us

SHAPES = [(1, 512), (1, 4096), (32, 512), (32, 4096)]


def op_table(compiled: dict, dtype: torch.dtype, iters: int) -> list[float]:
    print(f"{'op':<24}{'tokens':>7}{'hidden':>7}{'compiled us':>13}{'torch us':>12}{'ratio':>8}")
    ratios = []
    for op in ops.OP_NAMES:
        for tokens, hidden in SHAPES:
            args = cases.bench_case(op, dtype, "cpu", tokens=tokens, hidden=hidden)
            ours, ref = compare_us(compiled[op], getattr(reference, op), args, iters)
            ratios.append(ref / ours)
            print(f"{op:<24}{tokens:>7}{hidden:>7}{ours:>13.1f}{ref:>12.1f}{ref / ours:>7.2f}x", flush=True)
            if op == "moe_experts" and grouped_moe.available() and grouped_moe.fits(*args[:3]):
                # torch's grouped GEMM (what a CUDA build may route moe_experts to): against torch's reference,
                # and in the last column against this build's kernel
                theirs, ref = compare_us(grouped_moe.moe_experts, getattr(reference, op), args, iters)
                print(f"{op + ' (grouped_mm)':<24}{tokens:>7}{hidden:>7}{theirs:>13.1f}{ref:>12.1f}{ref / theirs:>7.2f}x"
                      f"   ours {theirs / ours:.2f}x faster", flush=True)
            if op == "moe_experts" and compiled[op].tiles_fit(args[1], args[2]):
                # the layout the engine loads these weights in; torch keeps its row-major weights
                x, w13, w2, weights, ids = args
                tiled = (x, to_tiles(w13), to_tiles(w2), weights, ids, True)
                ours, ref = compare_us(lambda *_: compiled[op](*tiled), getattr(reference, op), args, iters)
                ratios.append(ref / ours)
                print(f"{op + ' (tiled)':<24}{tokens:>7}{hidden:>7}{ours:>13.1f}{ref:>12.1f}{ref / ours:>7.2f}x", flush=True)
    return ratios


def streamed_moe(compiled: dict, dtype: torch.dtype, layers: int = 8, rounds: int = 5) -> None:
    """The MoE experts as a model streams them: one call per layer over `layers` layers of the default model's
    expert shapes, so each call finds its weights out of cache, as decode does. Row-major and (where this
    build reads them on tiles) tiled weights, against torch's reference on the row-major ones."""
    experts, hidden, inter = 8, 512, 1024
    gen = torch.Generator().manual_seed(0)
    w13 = [(torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).to(dtype) for _ in range(layers)]
    w2 = [(torch.randn(experts, hidden, inter, generator=gen) * 0.02).to(dtype) for _ in range(layers)]
    fn = compiled["moe_experts"]
    tiled = fn.tiles_fit(w13[0], w2[0])
    t13, t2 = ([to_tiles(w) for w in w13], [to_tiles(w) for w in w2]) if tiled else (None, None)
    print(f"\nmoe_experts streamed over {layers} layers ({experts} experts top-2, hidden {hidden}, inter {inter}), "
          f"ms a layer:")
    print(f"{'tokens':>7}{'row-major':>11}{'tiled':>9}{'torch':>9}{'ratio':>8}")
    for tokens in (8, 32, 128):
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, 2, generator=gen), dim=-1)
        sides = {"row-major": lambda i: fn(x, w13[i], w2[i], weights, ids),
                 "torch": lambda i: reference.moe_experts(x, w13[i], w2[i], weights, ids)}
        if tiled:
            sides["tiled"] = lambda i: fn(x, t13[i], t2[i], weights, ids, True)
        samples: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(rounds):  # alternate so machine load hits every side alike
            for name, call in sides.items():
                t0 = time.perf_counter()
                for i in range(layers):
                    call(i)
                samples[name].append((time.perf_counter() - t0) * 1e3 / layers)
        ms = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
        ours = ms.get("tiled", ms["row-major"])
        tiles = f"{ms['tiled']:9.2f}" if tiled else f"{'-':>9}"
        print(f"{tokens:>7}{ms['row-major']:11.2f}{tiles}{ms['torch']:9.2f}{ms['torch'] / ours:7.2f}x", flush=True)


def small_model(dtype: str):
    from engine.model.config import ModelConfig
    from engine.model.decoder import MoEForCausalLM

    config = ModelConfig(vocab_size=2048, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
                         head_dim=64, num_experts=8, experts_per_token=2, intermediate_size=1024,
                         moe_intermediate_size=512, max_position_embeddings=1024, dtype=dtype)
    torch.manual_seed(0)
    model = MoEForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return config, model


def decode_tokens_per_s(config, model, batch: int, prompt: int, steps: int) -> tuple[float, list]:
    from engine.model.paged import AttentionMetadata, allocate_kv_cache

    block = 16
    per_seq = (prompt + steps + block - 1) // block
    kv = allocate_kv_cache(config, batch * per_seq, block)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    ids = torch.randint(0, config.vocab_size, (batch * prompt,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(prompt).repeat(batch)
    meta = AttentionMetadata.build([prompt] * batch, [prompt] * batch, tables, block)
    nxt = model.logits(model(ids, pos, kv, meta).view(batch, prompt, -1)[:, -1]).argmax(-1)
    out = [nxt]
    t0 = time.perf_counter()
    for s in range(steps):
        ctx = prompt + s + 1
        meta = AttentionMetadata.build([1] * batch, [ctx] * batch, tables, block)
        hidden = model(nxt, torch.full((batch,), ctx - 1), kv, meta)
        nxt = model.logits(hidden).argmax(-1)
        out.append(nxt)
    return batch * steps / (time.perf_counter() - t0), torch.stack(out).tolist()


def end_to_end(compiled: dict, dtype: str) -> float | None:
    try:
        config, model = small_model(dtype)
    except ImportError as exc:
        print(f"end-to-end skipped: engine.model unavailable ({exc})")
        return None
    rates = {"compiled": [], "reference": []}
    for _ in range(2):  # alternate so machine load hits both sides
        for side in ("compiled", "reference"):
            ops.use_reference()
            if side == "compiled":
                for name, fn in compiled.items():
                    ops.use_compiled(name, fn)
            rate, _ = decode_tokens_per_s(config, model, batch=4, prompt=64, steps=24)
            rates[side].append(rate)
    ops.use_reference()
    ours, ref = max(rates["compiled"]), max(rates["reference"])
    print(f"\nend-to-end decode ({dtype}, 4 layers, hidden 512, 8 experts top-2, batch 4, 24 steps):")
    print(f"  compiled ops {ours:8.1f} tok/s   reference ops {ref:8.1f} tok/s   ratio {ours / ref:.2f}x")
    return ours / ref


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args(argv)
    manifest = build(BuildRequest(arch="native", bench_iters=2, bench_hidden=512),
                     progress=lambda m: print(f"kernels: {m}", file=sys.stderr))
    compiled = load_cached(arch=manifest.arch, key=manifest.cache_key)
    ops.use_reference()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, {manifest.compiler}\n")
    ratios = op_table(compiled, getattr(torch, args.dtype), args.iters)
    geo = torch.tensor(ratios).log().mean().exp().item()
    print(f"\ngeometric mean ratio {geo:.2f}x, min {min(ratios):.2f}x")
    streamed_moe(compiled, getattr(torch, args.dtype))
    if not args.skip_e2e:
        end_to_end(compiled, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
