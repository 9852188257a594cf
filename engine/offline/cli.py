"""Model commands: `tideflow model init` writes the default checkpoint, `tideflow generate` runs it."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine.runtime.paths import default_model_dir
from tideflow_kernels.spec import KERNEL_MODES


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="model checkpoints")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    init = model_sub.add_parser("init", help="write the default (random-weight) MoE checkpoint")
    init.add_argument("dir", nargs="?", type=Path, default=None, help="target directory (default: $TIDEFLOW_HOME/models/default)")
    init.add_argument("--seed", type=int, default=0, help="weights seed")
    init.add_argument("--tiny", action="store_true", help="write the 2-layer test model instead")
    init.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    init.set_defaults(func=_init)

    gen = subparsers.add_parser("generate", help="generate text with the batched reference loop")
    gen.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the default model)")
    gen.add_argument("--prompt", action="append", default=None, help="prompt text (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    gen.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:<index>")
    gen.add_argument("--kernels", choices=KERNEL_MODES, default=None,
                     help="auto (default): build the compiled ops once if missing; cached; reference")
    gen.set_defaults(func=_generate)


def _init(args: argparse.Namespace) -> int:
    from engine.offline.default_model import DEFAULT_CONFIG, TINY_CONFIG, write_default_model

    config = (TINY_CONFIG if args.tiny else DEFAULT_CONFIG).model_copy(update={"dtype": args.dtype})
    out = write_default_model(args.dir or default_model_dir(), config, seed=args.seed)
    print(f"wrote {config.param_count() / 1e6:.1f}M-parameter {config.architecture} to {out} (random weights, seed {args.seed})")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.offline.generate import GenerationStats, generate
    from engine.model.loader import load_model
    from engine.model.config import read_config
    from engine.runtime.device import resolve_device
    from tideflow_kernels.startup import arch_for, startup_ops
    from engine.core.sampling_params import SamplingParams
    from engine.model.tokenizer import Tokenizer

    model_dir = args.model or default_model_dir()
    if args.model is None and not (model_dir / "config.json").exists():
        _init(argparse.Namespace(dir=model_dir, seed=0, tiny=False, dtype=args.dtype or "float32"))
    t0 = time.perf_counter()
    device = resolve_device(args.device)
    read_config(model_dir, args.dtype)  # a wrong directory is one line now, not after a kernel build
    tok = Tokenizer(model_dir)
    compiled = startup_ops(arch_for(device), args.kernels)
    model = load_model(model_dir, args.dtype, device)
    load_s = time.perf_counter() - t0
    prompts = args.prompt or ["The release pipeline compiles the kernels, publishes the weights and"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    stats = GenerationStats()
    outs = generate(model, tok, [tok.encode(p) for p in prompts], params, stats=stats)
    for prompt, out in zip(prompts, outs):
        print(f"--- prompt: {prompt!r}\n{out.text!r}  [{len(out.tokens)} tokens, finish: {out.finish_reason}]")
    print(f"load {load_s:.2f}s | prefill {stats.prefill_s * 1000:.0f} ms | decode {stats.generated} tokens in "
          f"{stats.decode_s:.2f}s = {stats.decode_tokens_per_s:.1f} tokens/s (batch {len(prompts)}, "
          f"{len(compiled)} compiled ops)")
    return 0
