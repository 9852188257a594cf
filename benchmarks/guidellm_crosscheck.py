"""Cross-check the load drill against guidellm: same server, same constant rate, same lengths; print both and the ratio.

    python benchmarks/guidellm_crosscheck.py [--server engine|reference] [--rate 4] [--requests 40]

guidellm lives in its own venv (it pins an older click and adds uvloop/httptools, which would change the main venv):
    python3.11 -m venv .venv-guidellm && .venv-guidellm/bin/pip install guidellm "$(grep ^torch== constraints.txt)"
Target: TTFT p50 and output tokens/s within 15% of guidellm's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import print_table
from engine.offline.default_model import TINY_CONFIG, write_default_model
from drills.load import run_load_drill
from drills.spec import LoadDrillSpec
from engine.runtime.process import Child, free_port, tideflow_argv, wait_http_ok

REPO = Path(__file__).resolve().parents[1]
KEY = "crosscheck-key"


@contextlib.contextmanager
def server(kind: str, model_dir: Path, ttft_ms: float, tpot_ms: float):
    """Start the engine (tiny model) or the reference server as a subprocess on 127.0.0.1; yield (url, model id)."""
    port = free_port()
    if kind == "engine":
        cmd = tideflow_argv("serve", "--model", str(model_dir), "--port", str(port), "--served-model-name", "tiny",
                            "--kv-cache-bytes", str(32 << 20), "--max-wait-ms", "1")
        model, ready = "tiny", "/ready"
    else:
        cmd = [sys.executable, "-m", "harness.reference_server", "--port", str(port), "--model", "reference",
               "--ttft-ms", str(ttft_ms), "--tpot-ms", str(tpot_ms), "--slots", "256"]
        model, ready = "reference", "/health"
    child = Child(f"{kind}-server", cmd, model_dir.parent / f"{kind}-server.log", {"TIDEFLOW_API_KEYS": KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_http_ok(url + ready, 120, child, KEY):
            raise RuntimeError(f"{kind} server not ready: {child.log_tail()}")
        yield url, model
    finally:
        child.stop()


def run_guidellm(binary: str, url: str, model: str, model_dir: Path, args, out: Path) -> dict:
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
                    "http2": False, "api_key": KEY},
        "profile": {"kind": "constant", "rate": args.rate},
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(model_dir)},
        "constraints": [{"kind": "max_requests", "count": args.requests}],
        "outputs": [{"kind": "json", "path": str(out / "guidellm.json")}],
    }}
    (out / "scenario.json").write_text(json.dumps(scenario))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run([binary, "run", "-c", str(out / "scenario.json"), "--disable-console"], cwd=out, env=env,
                   check=True, timeout=600)
    bench = json.loads((out / "guidellm.json").read_text())["benchmarks"][0]["metrics"]
    return {
        "ttft_p50": bench["time_to_first_token_ms"]["successful"]["median"],
        "itl_p50": bench["inter_token_latency_ms"]["successful"]["median"],
        "output_tok_s": bench["output_tokens_per_second"]["successful"]["mean"],
        "ok": bench["request_totals"]["successful"], "error": bench["request_totals"]["errored"],
    }


def run_ours(url: str, model: str, model_dir: Path, args, seed: int) -> dict:
    """One drill at the same constant rate; a fresh seed each run so no prompt hits the server's prefix cache."""
    os.environ["CROSSCHECK_KEY"] = KEY
    spec = LoadDrillSpec(url=url, model=model, api_key_env="CROSSCHECK_KEY", rate=args.rate,
                         duration_s=args.requests / args.rate, arrival="constant",
                         prompt_len=f"fixed:{args.prompt_tokens}", output_len=f"fixed:{args.output_tokens}",
                         tokenizer_dir=model_dir, seed=seed, progress_bar=False, expectations_suite=None)
    (step,) = run_load_drill(spec).steps
    return {"ttft_p50": step.ttft_p50, "itl_p50": step.itl_p50, "output_tok_s": step.output_tok_s,
            "ok": step.ok, "error": step.error}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", choices=["engine", "reference"], default="engine")
    p.add_argument("--rate", type=float, default=4.0, help="constant request rate (req/s) for both tools")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--ttft-ms", type=float, default=100.0, help="reference server only")
    p.add_argument("--tpot-ms", type=float, default=20.0, help="reference server only")
    p.add_argument("--guidellm", default=os.environ.get("GUIDELLM", str(REPO / ".venv-guidellm" / "bin" / "guidellm")))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model_dir = write_default_model(out / "tiny-model", TINY_CONFIG, seed=0)
        with server(args.server, model_dir, args.ttft_ms, args.tpot_ms) as (url, model):
            run_ours(url, model, model_dir, argparse.Namespace(**{**vars(args), "requests": 8}), seed=0)  # warm-up
            # Ours runs before and after guidellm: on a shared machine the spread between the two shows the noise.
            before = run_ours(url, model, model_dir, args, seed=1)
            theirs = run_guidellm(args.guidellm, url, model, model_dir, args, out)
            after = run_ours(url, model, model_dir, args, seed=2)
    print(f"server: {args.server}; constant {args.rate:g} req/s x {args.requests} requests, "
          f"{args.prompt_tokens} prompt / {args.output_tokens} output tokens; load average {os.getloadavg()[0]:.1f}")
    ours = {m: (before[m] + after[m]) / 2 for m in before}
    rows = [[m, before[m], after[m], theirs[m], ours[m] / theirs[m] if theirs[m] else float("nan")]
            for m in ("ttft_p50", "itl_p50", "output_tok_s")]
    rows += [[m, before[m], after[m], theirs[m], "-"] for m in ("ok", "error")]
    print_table(["metric", "drill (before)", "drill (after)", "guidellm", "ratio (drill mean / guidellm)"], rows)
    worst = max(abs(ours[m] / theirs[m] - 1) for m in ("ttft_p50", "output_tok_s"))
    print(f"TTFT p50 and output tok/s agree within {worst:.1%} (target 15%)")


if __name__ == "__main__":
    main()
