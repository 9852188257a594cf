"""Load compiled ops from the cache without compiling: per op, the newest artifact for this
arch and torch version whose latest verification passed, among the builds of one source tree when a
cache key is given. The engine calls `load_cached` once at start, with the key of its own sources;
ops without such a build stay on the torch reference."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Callable

from tideflow_kernels import cache, grouped_moe, ops
from tideflow_kernels.spec import BuildManifest, backend_of

log = logging.getLogger(__name__)


def implementations(backend: str, artifact: Path, key: str, names) -> dict[str, Callable]:
    """The per-op entry points (kernels.<backend>.<op>) bound to one built artifact."""
    if backend == "cpu":
        from tideflow_kernels.cpu import extension

        lib = extension.load(artifact.parent, key)
    else:
        from tideflow_kernels.cuda import library

        lib = library.load(artifact)
    return {n: importlib.import_module(f"tideflow_kernels.{backend}.{n}").make(lib) for n in names}


def newest_verified(manifests: list[BuildManifest]) -> dict[str, BuildManifest]:
    """op -> manifest of the newest artifact whose most recent check of that op passed."""
    latest: dict[tuple[str, str], tuple[BuildManifest, str]] = {}
    for m in manifests:  # oldest first, so later builds of an artifact overwrite earlier ones
        for r in m.results:
            latest[(m.cache_key, r.op)] = (m, r.status)
    chosen: dict[str, BuildManifest] = {}
    for (_, op), (m, status) in latest.items():
        if status == "verified" and (op not in chosen or m.created_at > chosen[op].created_at):
            chosen[op] = m
    return chosen


def _variant(manifest: BuildManifest, op: str) -> str:
    return next((r.variant for r in reversed(manifest.results) if r.op == op), "compiled")


def load_cached(arch: str = "cpu", key: str | None = None) -> dict[str, Callable]:
    """Route every op with a cached verified build to it (tideflow_kernels.ops.use_compiled), for tensors of the
    build's device (a CPU arch: CPU tensors; sm_XX: CUDA tensors). With `key`, only builds of that cache key
    count: a home also holds builds of other sources (an older release after a rollback, a build tried
    with other flags), and the newest of those is not the one this code was verified with."""
    backend = backend_of(arch)
    manifests = cache.read_manifests(backend, arch)
    if key is not None:
        manifests = [m for m in manifests if m.cache_key == key]
    chosen = newest_verified(manifests)
    loaded: dict[str, Callable] = {}
    for key in {m.cache_key for m in chosen.values()}:
        names = [op for op, m in chosen.items() if m.cache_key == key]
        m = chosen[names[0]]
        try:
            impls = implementations(backend, Path(m.artifact), key, names)
        except (OSError, RuntimeError) as exc:
            log.warning("kernels: cached build %s unusable, keeping reference for %s: %s",
                        key, ", ".join(names), exc)
            continue
        for name, fn in impls.items():
            if _variant(chosen[name], name) == grouped_moe.VARIANT:  # the build measured it faster
                fn = grouped_moe.make(fn)
            ops.use_compiled(name, fn, "cpu" if backend == "cpu" else "cuda")
            loaded[name] = fn
        if backend == "cpu":
            from tideflow_kernels.cpu import extension

            ops.use_thread_binder(getattr(extension.load(Path(m.artifact).parent, key), "bind_threads", None))
    missing = [op for op in ops.OP_NAMES if op not in loaded]
    if missing:
        log.info("kernels: no verified %s build%s for %s; using the reference", arch,
                 f" of the current sources ({key})" if key else "", ", ".join(missing))
    return loaded
