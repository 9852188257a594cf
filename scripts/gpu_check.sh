#!/usr/bin/env bash
# The GPU path end to end on a machine with a GPU, in one run bounded to 8 minutes (issue #23):
#   1. build the CUDA ops for this GPU's arch with nvcc, verify each against torch, time both (tideflow_kernels.gpu_check)
#   2. harness.gpu_check --device cuda: ops routed per device, paged attention vs SDPA, parity with transformers
#      on the GPU, `tideflow serve --device cuda` through the openai client, DEP2 over NCCL (two GPUs), and
#      decode tok/s against transformers generate() on the GPU.
#   3. bench (benchmarks/gpu_decode.py, issue #40): the engine's tok/s at 1, 32, 128 and 256 streams eager and with
#      CUDA graphs side by side, and a 32-stream step's device-busy share, launches and host syncs; in what is left
#      of the 8 minutes (skipped under 90 s).
# Needs: torch built for CUDA and nvcc (PATH, /usr/local/bin or /usr/local/cuda/bin), and the project's
# dependencies (pip install -e .); PYTHON picks the interpreter (default: .venv/bin/python, else python3).
# Exit codes: 0 all passed, 1 a step failed, 2 no GPU / no nvcc / missing dependencies.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export TIDEFLOW_HOME="${TIDEFLOW_HOME:-$(mktemp -d -t tideflow-gpu-home-XXXXXX)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

if ! "$PY" - <<'PYEOF'
import importlib.util, sys
missing = [m for m in ("torch", "transformers", "openai", "fastapi", "uvicorn", "safetensors", "tokenizers",
                       "prometheus_client", "pydantic", "httpx", "yaml") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages: {', '.join(missing)} (pip install -e . into this interpreter)")
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (CPU build, no driver, or CUDA_VISIBLE_DEVICES)")
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.device_count()} GPU(s): "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
PYEOF
then
  exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

echo "== 1/3 CUDA ops: build, verify, time (tideflow_kernels.gpu_check)"
timeout 240 "$PY" -m tideflow_kernels.gpu_check --bench-iters 50
ops_rc=$?

echo "== 2/3 the GPU path (harness.gpu_check --device cuda)"
left=$((480 - ($(date +%s) - start)))
timeout "$left" "$PY" -m harness.gpu_check --device cuda
path_rc=$?

echo "== 3/3 bench: eager vs CUDA graphs (benchmarks/gpu_decode.py)"
left=$((480 - ($(date +%s) - start)))
bench_rc=0
if [ "$left" -ge 90 ]; then
  timeout "$left" "$PY" benchmarks/gpu_decode.py
  bench_rc=$?
else
  echo "bench: skipped, ${left}s left of the bound"
fi

echo "gpu_check: done in $(($(date +%s) - start)) s (kernels exit $ops_rc, path exit $path_rc, bench exit $bench_rc)"
if [ "$ops_rc" -eq 2 ] || [ "$path_rc" -eq 2 ]; then exit 2; fi
[ "$ops_rc" -eq 0 ] && [ "$path_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
