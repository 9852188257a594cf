"""On a CUDA machine: compile the .cu sources for this GPU's arch, check every op against the
torch reference on the GPU and time both. Run as `python -m tideflow_kernels.gpu_check`; needs only
torch with CUDA and nvcc. Exit code 1 when an op fails, 2 when there is no GPU or nvcc."""

from __future__ import annotations

import argparse
import sys

import torch

from tideflow_kernels.build import build
from tideflow_kernels.cuda.library import nvcc
from tideflow_kernels.errors import BuildFailed
from tideflow_kernels.report import table
from tideflow_kernels.spec import BuildRequest
from tideflow_kernels.startup import arch_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tideflow_kernels.gpu_check", description=__doc__)
    parser.add_argument("--opt-level", type=int, default=3, choices=range(4))
    parser.add_argument("--bench-iters", type=int, default=100)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device (CPU torch build or no GPU)", file=sys.stderr)
        return 2
    if nvcc() is None:
        print("gpu_check: nvcc not found", file=sys.stderr)
        return 2
    arch = arch_for(torch.device("cuda"))
    print(f"gpu_check: {torch.cuda.get_device_name()} ({arch}), torch {torch.__version__}")
    request = BuildRequest(arch=arch, opt_level=args.opt_level, bench_iters=args.bench_iters)
    try:
        manifest = build(request, progress=lambda msg: print(f"  {msg}", file=sys.stderr))
    except BuildFailed as exc:
        print(table(exc.manifest))
        print(str(exc), file=sys.stderr)
        return 1
    print(table(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
