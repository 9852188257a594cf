"""The GPU path end to end, in one run: what scripts/gpu_check.sh calls on a machine with a GPU.

Steps (each prints PASS/FAIL/SKIP with its figures; the exit code is 1 when any step failed):
  kernels    build and verify the compiled ops for the device (tideflow_kernels.startup, as `serve` does), list them
  attention  paged decode attention (the op the engine routes to) against F.scaled_dot_product_attention
  parity     our model against transformers on the same device: logits (fp32) and 32 greedy tokens
  serve      `tideflow serve --device <device>` as its own process, asked through the official openai client
  dep2       two DEP ranks (NCCL on cuda, one GPU each; gloo on cpu) serving, both asked through openai
  decode     decode tokens/s of tideflow's generate() and transformers' generate() on the device, with the ratio

The same code runs with `--device cpu`, which is how CI keeps this script from rotting on GPU-less machines.

Run: python -m harness.gpu_check --device cuda [--steps kernels,attention,...] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

STEPS = ("kernels", "attention", "parity", "serve", "dep2", "decode")
API_KEY = "gpu-check-key"


class Skip(Exception):
    """A step that does not apply here (e.g. DEP2 with one GPU)."""


class Check:
    def __init__(self, device: torch.device, dtype: str, work: Path, tiny: bool = False) -> None:
        self.device, self.dtype, self.work, self.tiny = device, dtype, work, tiny
        self._model_dir: Path | None = None

    def model_dir(self) -> Path:
        """The default model (random weights, real tokenizer; the 2-layer one with --tiny), written once per run."""
        if self._model_dir is None:
            from engine.offline.default_model import DEFAULT_CONFIG, TINY_CONFIG, write_default_model

            config = TINY_CONFIG if self.tiny else DEFAULT_CONFIG
            self._model_dir = write_default_model(self.work / "model", config.model_copy(update={"dtype": "float32"}))
        return self._model_dir

    # ---- steps -------------------------------------------------------------------------------------------------
    def kernels(self) -> str:
        from tideflow_kernels import ops
        from tideflow_kernels.startup import arch_for, startup_ops

        arch = arch_for(self.device)
        loaded = startup_ops(arch, "auto", progress=lambda msg: print(f"    {msg}", flush=True))
        routed = {op: ops.implementation(op, self.device.type) for op in ops.OP_NAMES}
        missing = [op for op, impl in routed.items() if impl == "reference"]
        if missing:
            raise AssertionError(f"no verified {arch} build for {', '.join(missing)} (see the lines above)")
        return f"{len(loaded)} ops built for {arch}, verified and routed for {self.device.type} tensors"

    def attention(self) -> str:
        from tideflow_kernels import ops

        torch.manual_seed(0)
        dtype = getattr(torch, self.dtype)
        batch, heads, kv_heads, dim, block, blocks = 8, 16, 4, 128, 16, 1024
        lens = torch.randint(1, 1000, (batch,), generator=torch.Generator().manual_seed(1))
        k_cache = torch.randn(blocks, block, kv_heads, dim, device=self.device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        per_seq = -(-int(lens.max()) // block)
        tables = torch.randperm(blocks)[: batch * per_seq].view(batch, per_seq).to(self.device, torch.int32)
        q = torch.randn(batch, heads, dim, device=self.device, dtype=dtype)
        scale = dim ** -0.5
        out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens.to(self.device, torch.int32), scale)
        worst = 0.0
        for b in range(batch):
            n = int(lens[b])
            group = heads // kv_heads  # grouped-query: each KV head serves `group` query heads
            k = k_cache[tables[b].long()].reshape(-1, kv_heads, dim)[:n].transpose(0, 1).repeat_interleave(group, 0)
            v = v_cache[tables[b].long()].reshape(-1, kv_heads, dim)[:n].transpose(0, 1).repeat_interleave(group, 0)
            want = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k.float(), v.float(), scale=scale)
            worst = max(worst, (out[b].float() - want.squeeze(1)).abs().max().item())
        limit = 2e-2 if self.dtype == "bfloat16" else 1e-4
        if not worst <= limit:
            raise AssertionError(f"max abs error {worst:.2e} > {limit:.0e}")
        return f"{ops.implementation('paged_decode_attention', self.device.type)}: max abs error {worst:.1e} vs SDPA ({self.dtype})"

    def parity(self) -> str:
        """Teacher-forced: both models read the prompt and transformers' 32 greedy tokens; the logits must agree,
        and so must every greedy choice whose top-2 margin is wider than that difference (random weights give
        near-ties, where either choice is right). Our own greedy run is then compared token by token."""
        import transformers

        from engine.offline.generate import generate
        from engine.model.loader import load_model
        from engine.core.sampling_params import SamplingParams

        torch.backends.cuda.matmul.allow_tf32 = False  # the reference must be fp32, as ours is
        torch.manual_seed(1234)
        config = transformers.MixtralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                            num_local_experts=8, num_experts_per_tok=2)
        hf = transformers.MixtralForCausalLM(config).eval()
        path = self.work / "parity"
        hf.save_pretrained(path)
        hf = hf.to(self.device)
        ours = load_model(path, "float32", self.device)
        prompt = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(7)).to(self.device)
        with torch.no_grad():
            ids = prompt.unsqueeze(0)
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                               do_sample=False, pad_token_id=0)[0, len(prompt):]
            sequence = torch.cat([prompt, want])[:-1]
            theirs = hf(sequence.unsqueeze(0)).logits[0].float()
        mine = _logits(ours, sequence)
        err = (mine - theirs).abs().max().item()
        if not err < 1e-3:
            raise AssertionError(f"logits differ from transformers by {err:.2e} (limit 1e-3)")
        top2 = theirs[len(prompt) - 1:].topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 2 * err
        chosen = mine[len(prompt) - 1:].argmax(-1)
        wrong = ((chosen != want) & decisive).nonzero().flatten().tolist()
        if wrong:
            raise AssertionError(f"greedy choices differ from transformers at generated positions {wrong}")
        got = generate(ours, None, [prompt.tolist()], SamplingParams(max_tokens=32, ignore_eos=True))[0].tokens
        agree = next((i for i, (a, b) in enumerate(zip(got, want.tolist())) if a != b), len(got))
        if agree < len(got) and bool(decisive[agree]):
            raise AssertionError(f"our greedy run left transformers' at token {agree} where the choice was clear")
        return (f"logits max abs diff {err:.1e} over {len(sequence)} positions; {int(decisive.sum())}/32 decisive greedy "
                f"choices identical; our own greedy run agrees for {agree}/32 tokens"
                + ("" if agree == 32 else " (then a near-tie)"))

    def serve(self) -> str:
        with _Members(self, ranks=1) as members:
            return members.ask()

    def dep2(self) -> str:
        if self.device.type == "cuda" and torch.cuda.device_count() < 2:
            raise Skip(f"DEP2 over NCCL needs two GPUs; this machine has {torch.cuda.device_count()}")
        with _Members(self, ranks=2) as members:
            return members.ask()

    def decode(self) -> str:
        from transformers import AutoModelForCausalLM

        from engine.offline.generate import GenerationStats, generate
        from engine.model.loader import load_model
        from engine.core.sampling_params import SamplingParams

        dtype = getattr(torch, self.dtype)
        path = self.model_dir()
        ours = load_model(path, self.dtype, self.device)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        rows = []
        for batch in (1, 8):
            prompts = torch.randint(0, min(8000, hf.config.vocab_size), (batch, 32),  # --tiny: 512 tokens
                                    generator=torch.Generator().manual_seed(batch))
            params = SamplingParams(max_tokens=64, ignore_eos=True)
            generate(ours, None, prompts[:1].tolist(), SamplingParams(max_tokens=2, ignore_eos=True))
            stats = GenerationStats()
            generate(ours, None, prompts.tolist(), params, stats=stats)
            theirs = hf_decode_rate(hf, prompts.to(self.device), 64)
            rows.append(f"batch {batch}: tideflow {stats.decode_tokens_per_s:.0f} tok/s, transformers {theirs:.0f} tok/s, "
                        f"ratio {stats.decode_tokens_per_s / theirs:.2f}x")
        return "; ".join(rows) + f" ({self.dtype}, {'tiny' if self.tiny else 'default'} model)"


class _Members:
    """`ranks` `tideflow serve` processes of one instance on this device, reaped on exit whatever happened."""

    def __init__(self, check: Check, ranks: int) -> None:
        self.check, self.ranks = check, ranks
        self.children: list = []
        self.urls: list[str] = []

    def __enter__(self) -> "_Members":
        from engine.runtime.process import Child, free_port, tideflow_argv, wait_http_ok

        model = str(self.check.model_dir())
        dist = f"127.0.0.1:{free_port()}"
        try:
            for rank in range(self.ranks):
                port = free_port()
                argv = ["serve", "--model", model, "--port", str(port), "--device", self.check.device.type,
                        "--dtype", self.check.dtype, "--kv-cache-fraction", "0.3" if self.check.device.type == "cuda" else "0.05"]
                env = {"TIDEFLOW_API_KEYS": API_KEY}
                if self.ranks > 1:
                    argv += ["--dep-rank", str(rank), "--dep-size", str(self.ranks), "--dist-addr", dist]
                    if self.check.device.type == "cuda":
                        env["CUDA_VISIBLE_DEVICES"] = str(rank)  # one GPU each, as the local backend gives them
                log = self.check.work / f"serve-{self.ranks}-{rank}.log"
                self.children.append(Child(f"gpu-check-rank{rank}", tideflow_argv(*argv), log, env))
                self.urls.append(f"http://127.0.0.1:{port}")
            for child, url in zip(self.children, self.urls):
                if not wait_http_ok(url + "/ready", timeout_s=240, child=child):
                    raise AssertionError(f"{child.name} did not become ready: {child.log_tail(8)}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def ask(self) -> str:
        import httpx
        import openai

        texts = []
        for url in self.urls:
            client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0,
                                   http_client=httpx.Client(trust_env=False, timeout=120))
            model = client.models.list().data[0].id
            t0 = time.perf_counter()
            chunks = list(client.completions.create(model=model, prompt="The release pipeline", max_tokens=32,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True}))
            seconds = time.perf_counter() - t0
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            if not text:
                raise AssertionError(f"{url} streamed no text")
            texts.append(f"{len(chunks)} chunks in {seconds:.2f}s")
        where = f"{self.ranks} DEP ranks" if self.ranks > 1 else "one member"
        return f"{where} on {self.check.device.type}, openai client: " + ", ".join(texts)

    def __exit__(self, *exc) -> None:
        for child in self.children:
            child.stop(grace_s=10)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    from engine.model.paged import AttentionMetadata, allocate_kv_cache

    block = 16
    kv = allocate_kv_cache(model.config, num_blocks=-(-len(ids) // block), block_size=block, device=ids.device)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(len(kv[0][0])))], block, device=ids.device)
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(len(ids), device=ids.device), kv, meta)).float()


def hf_decode_rate(hf, ids: torch.Tensor, new_tokens: int) -> float:
    """transformers' decode tokens/s: time(prompt + n tokens) - time(prompt + 1 token)."""

    def run(n: int) -> float:
        _sync(ids.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=0)
        _sync(ids.device)
        return time.perf_counter() - t0

    run(2)
    return ids.shape[0] * (new_tokens - 1) / (run(new_tokens) - run(1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="attention, serve, dep2 and decode dtype (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    ap.add_argument("--tiny", action="store_true", help="serve the 2-layer model instead of the default one (CI)")
    args = ap.parse_args(argv)
    from engine.runtime.device import DeviceError, resolve_device

    try:
        device = resolve_device(args.device)
    except DeviceError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        print(f"gpu_check: unknown steps {', '.join(unknown)}; choose from {', '.join(STEPS)}", file=sys.stderr)
        return 2
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gpu_check: {name}, torch {torch.__version__}, device {device}, dtype {dtype}", flush=True)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="tideflow-gpu-check-") as work:
        check = Check(device, dtype, Path(work), args.tiny)
        for step in steps:
            failed += _run(step, getattr(check, step))
    print(f"gpu_check: {'FAILED ' + str(failed) + ' step(s)' if failed else 'all steps passed'}", flush=True)
    return 1 if failed else 0


def _run(step: str, fn: Callable[[], str]) -> int:
    t0 = time.perf_counter()
    try:
        detail = fn()
    except Skip as exc:
        print(f"  SKIP {step}: {exc}", flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 - every failure is reported and the next step still runs
        print(f"  FAIL {step} ({time.perf_counter() - t0:.1f}s): {exc}", flush=True)
        traceback.print_exc()
        return 1
    print(f"  PASS {step} ({time.perf_counter() - t0:.1f}s): {detail}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
