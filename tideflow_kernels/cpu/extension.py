"""Compile and load the CPU extension: one `torch.utils.cpp_extension.load` of ops.cpp (every
op's header included), built in the cache directory and registered under an op namespace
unique to that artifact (build key + directory), so several builds, even the same key built
into two TIDEFLOW_HOMEs, load side by side in one process. Registering one namespace twice
aborts the interpreter, so a namespace is loaded at most once per process (under a lock)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
from pathlib import Path

import torch

from tideflow_kernels import isa
from tideflow_kernels.errors import CompileError

SOURCE_DIR = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
ENTRY = "ops.cpp"

_loaded: set[str] = set()
_load_lock = threading.Lock()  # two threads loading one namespace would register it twice


def flags(arch: str, opt_level: int) -> list[str]:
    march = [] if arch == "cpu" else [f"-march={arch}"]
    return [f"-O{opt_level}", "-fopenmp", *march, *isa.cflags(arch)]


def compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{cxx}: unavailable ({exc})"
    return out.stdout.splitlines()[0] if out.stdout else cxx


def namespace(build_dir: Path, key: str) -> str:
    """`tideflow_<key>_<dir digest>`: the same key built into another directory is another library."""
    where = hashlib.sha256(str(build_dir.resolve()).encode()).hexdigest()[:8]
    return f"tideflow_{key}_{where}"


def artifact_path(build_dir: Path, key: str) -> Path:
    return build_dir / f"{namespace(build_dir, key)}.so"


def compile_extension(source_dir: Path, build_dir: Path, key: str, cflags: list[str]) -> Path:
    """One compiler run; raises CompileError with the compiler's output on failure."""
    build_dir.mkdir(parents=True, exist_ok=True)
    ns = namespace(build_dir, key)
    with _load_lock:
        if ns in _loaded:
            raise CompileError(f"{ns} is already loaded in this process: delete {build_dir} and rebuild in a "
                               "fresh process (a loaded op namespace cannot be replaced)")
        return _compile_and_load(source_dir, build_dir, ns, cflags)


def _compile_and_load(source_dir: Path, build_dir: Path, ns: str, cflags: list[str]) -> Path:
    from torch.utils import cpp_extension  # deferred: imports setuptools machinery

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
    ns = namespace(build_dir, key)
    with _load_lock:
        if ns not in _loaded:
            torch.ops.load_library(str(artifact_path(build_dir, key)))
            _loaded.add(ns)
    return getattr(torch.ops, ns)
