"""Where builds live: $TIDEFLOW_HOME/kernels/<backend>-<arch>/<cache key>/, keyed by source
hash + flags + torch version + arch (+ the host CPU for -march=native)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from tideflow_kernels.atomic_file import atomic_write_text
from tideflow_kernels.spec import BuildManifest

SOURCE_SUFFIXES = (".h", ".cpp", ".cuh", ".cu")


def home() -> Path:
    """engine.runtime.paths.home's rule (kernels sit below the engine and import nothing of it): $TIDEFLOW_HOME, or
    ~/.tideflow when it is unset or empty."""
    return Path(os.environ.get("TIDEFLOW_HOME") or "~/.tideflow").expanduser()


def kernels_root() -> Path:
    return home() / "kernels"


def source_files(source_dir: Path) -> list[Path]:
    files = sorted(p for p in source_dir.iterdir() if p.suffix in SOURCE_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"no kernel sources ({', '.join(SOURCE_SUFFIXES)}) in {source_dir}")
    return files


def source_hash(source_dir: Path) -> str:
    h = hashlib.sha256()
    for p in source_files(source_dir):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _host_fingerprint() -> str:
    """-march=native output depends on the host CPU: its model and flags join the key."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return platform.machine() + "|" + "|".join(keep)


def cache_key(src_hash: str, flags: list[str], arch: str) -> str:
    parts = {"source": src_hash, "flags": flags, "torch": torch.__version__, "arch": arch}
    if arch == "native":
        parts["host"] = _host_fingerprint()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def build_dir(backend: str, arch: str, key: str) -> Path:
    return kernels_root() / f"{backend}-{arch}" / key


def manifest_path(artifact_dir: Path, target: str) -> Path:
    return artifact_dir / f"manifest-{target}.json"


def write_manifest(artifact_dir: Path, manifest: BuildManifest) -> Path:
    path = manifest_path(artifact_dir, manifest.target)
    atomic_write_text(path, manifest.model_dump_json(indent=2))  # readers never see a half-written manifest
    return path


def read_manifests(backend: str, arch: str) -> list[BuildManifest]:
    """Every manifest cached for this backend/arch and this torch version, oldest first."""
    out = []
    for path in (kernels_root() / f"{backend}-{arch}").glob("*/manifest-*.json"):
        try:
            m = BuildManifest.model_validate_json(path.read_text())
        except (OSError, ValueError):
            continue  # a manifest from an older schema or a torn copy is simply not a candidate
        if m.torch_version == torch.__version__ and Path(m.artifact).exists():
            out.append(m)
    return sorted(out, key=lambda m: m.created_at)
