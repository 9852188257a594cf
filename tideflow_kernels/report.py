"""Plain-text table of a build's per-op results, shared by the CLI and the GPU check."""

from __future__ import annotations

from tideflow_kernels.spec import BuildManifest


def _us(v: float | None) -> str:
    return f"{v:10.1f}" if v is not None else f"{'-':>10}"


def table(manifest: BuildManifest) -> str:
    head = (f"{'op':<24}{'status':<16}{'err fp32':>10}{'err bf16':>10}"
            f"{'ours us':>10}{'ref us':>10}{'ratio':>8}")
    rows = [head, "-" * len(head)]
    for r in manifest.results:
        e32, e16 = r.errors.get("float32"), r.errors.get("bfloat16")
        rows.append(
            f"{r.op:<24}{r.status:<16}"
            f"{(f'{e32:.2e}' if e32 is not None else '-'):>10}{(f'{e16:.2e}' if e16 is not None else '-'):>10}"
            f"{_us(r.compiled_us)}{_us(r.reference_us)}"
            f"{(f'{r.speedup:.2f}x' if r.speedup else '-'):>8}"
        )
    hit = "cache hit" if manifest.cache_hit else f"compiled in {manifest.compile_s:.1f}s"
    rows.append(f"{manifest.backend} {manifest.arch} {' '.join(manifest.flags)}; {hit}; "
                f"{manifest.compiler}; torch {manifest.torch_version}")
    return "\n".join(rows)
