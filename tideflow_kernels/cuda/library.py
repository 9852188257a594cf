"""Compile the .cu sources with nvcc into one shared library (one nvcc run) and load it with
ctypes; the launchers are `extern "C"` over raw device pointers, so no CUDA torch headers are
needed to build, only to run."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from tideflow_kernels.errors import CompileError

SOURCE_DIR = Path(__file__).resolve().parent.parent / "csrc" / "cuda"
LIBRARY = "libtideflow_cuda.so"
DTYPE_CODES = {"float32": 0, "bfloat16": 1}

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "tf_rms_norm": (_I32, [_P, _P, _P, _P, _P, _I64, _I64, _F32, _I32, _I32, _P]),
    "tf_rotary_embedding": (_I32, [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I32, _P]),
    "tf_topk_gating": (_I32, [_P, _P, _P, _I64, _I64, _I64, _I32, _I32, _P]),
    "tf_moe_workspace_bytes": (_I64, [_I64, _I64, _I64, _I64, _I64]),
    "tf_moe_experts": (_I32, [_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I32, _P]),
    "tf_paged_decode_attention": (
        _I32,
        [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _I32, _P],
    ),
}


def nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc") if os.access(p, os.X_OK)), None
    )


def flags(arch: str, opt_level: int) -> list[str]:
    return [f"-arch={arch}", f"-O{opt_level}", f"-Xptxas=-O{opt_level}", "-shared",
            "-Xcompiler=-fPIC", "-std=c++17"]


def compiler_version() -> str:
    exe = nvcc()
    if exe is None:
        return "nvcc: not found"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in out.stdout.splitlines() if "release" in ln]
    return lines[0].strip() if lines else exe


def compile_library(source_dir: Path, build_dir: Path, cflags: list[str]) -> Path:
    """One nvcc run over every .cu file; raises CompileError with nvcc's output on failure."""
    exe = nvcc()
    if exe is None:
        raise CompileError("nvcc not found on PATH, /usr/local/bin or /usr/local/cuda/bin")
    build_dir.mkdir(parents=True, exist_ok=True)
    out = build_dir / LIBRARY
    sources = sorted(str(p) for p in source_dir.glob("*.cu"))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")  # two builders never share it
    cmd = [exe, *cflags, "-o", str(tmp), *sources]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise CompileError(f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def check(rc: int, op: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{op}: CUDA launcher returned error {rc}")


def dtype_code(t) -> int:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPE_CODES:
        raise TypeError(f"expected float32 or bfloat16, got {t.dtype}")
    return DTYPE_CODES[name]


def stream():
    import torch

    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
