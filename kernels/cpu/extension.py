"""Compile and load the CPU extension: one `torch.utils.cpp_extension.load` of ops.cpp (every
op's header included), built in the cache directory and registered under a per-build op
namespace so several builds can be loaded side by side."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from kernels.errors import CompileError

SOURCE_DIR = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
ENTRY = "ops.cpp"

_loaded: set[str] = set()


def flags(arch: str, opt_level: int) -> list[str]:
    march = [] if arch == "cpu" else [f"-march={arch}"]
    return [f"-O{opt_level}", "-fopenmp", *march]


def compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{cxx}: unavailable ({exc})"
    return out.stdout.splitlines()[0] if out.stdout else cxx


def namespace(key: str) -> str:
    return f"tideflow_{key}"


def artifact_path(build_dir: Path, key: str) -> Path:
    return build_dir / f"{namespace(key)}.so"


def compile_extension(source_dir: Path, build_dir: Path, key: str, cflags: list[str]) -> Path:
    """One compiler run; raises CompileError with the compiler's output on failure."""
    from torch.utils import cpp_extension  # deferred: imports setuptools machinery

    build_dir.mkdir(parents=True, exist_ok=True)
    ns = namespace(key)
    try:
        path = cpp_extension.load(
            name=ns,
            sources=[str(source_dir / ENTRY)],
            extra_cflags=[*cflags, f"-DTIDEFLOW_NS={ns}"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        raise CompileError(str(exc)) from exc
    _loaded.add(ns)
    return Path(path)


def load(build_dir: Path, key: str):
    """The op namespace (torch.ops.<ns>) of a built artifact, loading it at most once."""
    ns = namespace(key)
    if ns not in _loaded:
        torch.ops.load_library(str(artifact_path(build_dir, key)))
        _loaded.add(ns)
    return getattr(torch.ops, ns)
