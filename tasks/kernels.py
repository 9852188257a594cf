"""compile_kernels: build, verify and time the custom ops; cached by source hash + flags + arch."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from tideflow_kernels.build import build, cache_key_of
from tideflow_kernels.spec import BuildManifest, BuildRequest


def _key(context, parameters) -> str:
    return "kernels-" + cache_key_of(parameters["request"])


@task(name="compile_kernels", cache_key_fn=_key, timeout_seconds=1800, persist_result=True)
def compile_kernels(request: BuildRequest) -> BuildManifest:
    """No retries: a compile error or a wrong result is the same on every try."""
    logger = get_run_logger()
    manifest = build(request, progress=logger.info)
    create_table_artifact(
        key="kernel-build",
        table=[{"op": r.op, "status": r.status, "max_rel_error": max(r.errors.values(), default=None),
                "compiled_us": r.compiled_us, "reference_us": r.reference_us, "speedup": r.speedup}
               for r in manifest.results],
        description=f"kernels for {manifest.arch} (-O{manifest.opt_level}), cache {'hit' if manifest.cache_hit else 'miss'}",
    )
    return manifest
