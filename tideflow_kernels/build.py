"""Build pipeline for the custom ops: compile (or hit the cache), check every op against its
reference on fresh random inputs, time both, and write a manifest next to the artifact.
`build()` is what `tideflow kernels build` and the Prefect task call."""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from tideflow_kernels import cache, cases, grouped_moe, ops, reference
from tideflow_kernels.errors import BuildFailed, CompileError
from tideflow_kernels.loader import implementations
from tideflow_kernels.spec import BuildManifest, BuildRequest, BuildResult
from tideflow_kernels.timing import compare_us

Progress = Callable[[str], None]
MAX_MESSAGE = 4000


def _toolchain(request: BuildRequest):
    if request.backend == "cpu":
        from tideflow_kernels.cpu import extension as tc

        return tc, tc.SOURCE_DIR, tc.flags(request.arch, request.opt_level)
    from tideflow_kernels.cuda import library as tc

    return tc, tc.SOURCE_DIR, tc.flags(request.arch, request.opt_level)


def _artifact(request: BuildRequest, build_dir: Path, key: str) -> Path:
    if request.backend == "cpu":
        from tideflow_kernels.cpu.extension import artifact_path

        return artifact_path(build_dir, key)
    from tideflow_kernels.cuda.library import LIBRARY

    return build_dir / LIBRARY


def _compile(request: BuildRequest, tc, source_dir: Path, build_dir: Path, key: str, flags) -> None:
    if request.backend == "cpu":
        tc.compile_extension(source_dir, build_dir, key, flags)
    else:
        tc.compile_library(source_dir, build_dir, flags)


def _culprits(message: str, names: tuple[str, ...]) -> list[str]:
    """Ops whose source file (<op>.h / <op>.cu) the compiler's error lines point at."""
    error_lines = [ln for ln in message.splitlines() if re.search(r"\berror\b", ln)]
    hits = [n for n in names if any(re.search(rf"\b{n}\.(h|cu|cuh)\b", ln) for ln in error_lines)]
    return hits or list(names)


def _excerpt(message: str) -> str:
    at = message.find("error")
    start = max(0, message.rfind("\n", 0, at) + 1) if at >= 0 else 0
    return message[start : start + MAX_MESSAGE]


def _verify(op: str, impl: Callable, device: str, request: BuildRequest) -> BuildResult:
    ref = getattr(reference, op)
    errors, limits = {}, {}
    for dtype in cases.CHECK_DTYPES:
        name = str(dtype).removeprefix("torch.")
        limits[name] = request.tolerances.get(op, cases.tolerance(op, dtype))
        worst = 0.0
        for args in cases.check_cases(op, dtype, device):
            try:
                got = impl(*args)
            except (RuntimeError, TypeError, ValueError) as exc:
                return BuildResult(op=op, status="wrong_result", tolerances=limits,
                                   message=f"{name} call raised: {exc}"[:MAX_MESSAGE])
            worst = max(worst, cases.relative_error(op, got, ref(*args), args))
        errors[name] = worst
    bad = {d: e for d, e in errors.items() if not e <= limits[d]}
    timing_dtype = torch.bfloat16
    args = cases.bench_case(op, timing_dtype, device, hidden=request.bench_hidden)
    compiled_us, reference_us = compare_us(impl, ref, args, request.bench_iters)
    result = BuildResult(
        op=op,
        status="wrong_result" if bad else "verified",
        errors=errors,
        tolerances=limits,
        compiled_us=compiled_us,
        reference_us=reference_us,
    )
    if bad:
        result.message = "; ".join(f"{d}: relative error {e:.3g} > limit {limits[d]:.3g}" for d, e in bad.items())
    return result


def _grouped_or_compiled(compiled: BuildResult, impl: Callable, device: str, request: BuildRequest,
                         say: Progress) -> tuple[BuildResult, Callable]:
    """moe_experts on torch's grouped GEMM, verified and timed as every op is, against the verified compiled kernel
    (which takes the calls the grouped GEMM cannot): the faster of the two."""
    grouped = grouped_moe.make(impl)
    say("checking moe_experts on torch._grouped_mm")
    tried = _verify("moe_experts", grouped, device, request)
    if tried.status != "verified" or tried.compiled_us >= compiled.compiled_us:
        return compiled, impl
    why = f"torch._grouped_mm {tried.compiled_us:.1f} us a call against this build's kernel {compiled.compiled_us:.1f} us"
    return tried.model_copy(update={"variant": grouped_moe.VARIANT, "message": why}), grouped


def _unverified(op: str) -> BuildResult:
    return BuildResult(op=op, status="unverified",
                       message="compiled; no CUDA device here to check it: run `python -m tideflow_kernels.gpu_check` on a GPU machine")


def cache_key_of(request: BuildRequest) -> str:
    """The artifact cache key `build(request)` would use: source hash + flags + torch + arch."""
    _, default_src, flags = _toolchain(request)
    return cache.cache_key(cache.source_hash(Path(request.source_dir or default_src)), flags, request.arch)


def build(request: BuildRequest, progress: Progress | None = None) -> BuildManifest:
    """Compile (unless cached), verify and time `request.ops`; raise BuildFailed naming the ops
    that failed to compile or disagree with the reference. Failed ops stay on the reference."""
    say = progress or (lambda _msg: None)
    tc, default_src, flags = _toolchain(request)
    source_dir = Path(request.source_dir or default_src)
    src_hash = cache.source_hash(source_dir)
    key = cache.cache_key(src_hash, flags, request.arch)
    build_dir = cache.build_dir(request.backend, request.arch, key)
    artifact = _artifact(request, build_dir, key)
    cache_hit = artifact.exists()
    compile_s = 0.0
    results: list[BuildResult] = []
    try:
        if cache_hit:
            say(f"cache hit {key} ({artifact})")
        else:
            say(f"compiling {request.backend} ops for {request.arch} ({' '.join(flags)})")
            t0 = time.perf_counter()
            _compile(request, tc, source_dir, build_dir, key, flags)
            compile_s = time.perf_counter() - t0
            say(f"compiled in {compile_s:.1f}s")
    except CompileError as exc:
        culprits = _culprits(str(exc), request.ops)
        text = _excerpt(str(exc))
        for op in request.ops:
            msg = (f"compile error: {text}" if op in culprits
                   else f"not built: the source set failed to compile in {', '.join(culprits)}")
            results.append(BuildResult(op=op, status="compile_failed", message=msg))
    if not results:
        run_here = request.backend == "cpu" or torch.cuda.is_available()
        impls = implementations(request.backend, artifact, key, request.ops) if run_here else {}
        device = "cpu" if request.backend == "cpu" else "cuda"
        for op in request.ops:
            if op not in impls:
                results.append(_unverified(op))
                continue
            say(f"checking {op}")
            results.append(_verify(op, impls[op], device, request))
            chosen = impls[op]
            if (op == "moe_experts" and request.backend == "cuda" and grouped_moe.available()
                    and results[-1].status == "verified"):
                results[-1], chosen = _grouped_or_compiled(results[-1], impls[op], device, request, say)
            if request.activate and results[-1].status == "verified":
                ops.use_compiled(op, chosen, device)
    manifest = BuildManifest(
        target=request.target,
        arch=request.arch,
        backend=request.backend,
        opt_level=request.opt_level,
        flags=flags,
        compiler=tc.compiler_version(),
        torch_version=torch.__version__,
        source_hash=src_hash,
        cache_key=key,
        cache_hit=cache_hit,
        artifact=str(artifact),
        compile_s=round(compile_s, 3),
        created_at=datetime.now(timezone.utc),
        results=results,
    )
    build_dir.mkdir(parents=True, exist_ok=True)
    say(f"manifest {cache.write_manifest(build_dir, manifest)}")
    if not manifest.ok:
        raise BuildFailed(manifest)
    return manifest
