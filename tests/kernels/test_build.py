"""The build pipeline: cache hits, compile failures and wrong results name the op, the engine
stays on the reference for failed ops, and load_cached picks verified builds (of the engine's own sources
when it starts)."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tideflow_kernels import ops, reference
from tideflow_kernels.build import build
from tideflow_kernels.cache import write_manifest
from tideflow_kernels.cpu.extension import SOURCE_DIR, artifact_path
from tideflow_kernels.errors import BuildFailed
from tideflow_kernels.loader import implementations, load_cached
from tideflow_kernels.spec import BuildManifest, BuildRequest
from tideflow_kernels.startup import startup_ops

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_first_build_compiles_and_verifies_every_op(cpu_build):
    manifest, _ = cpu_build
    assert manifest.ok and not manifest.cache_hit and manifest.compile_s > 0
    assert [r.op for r in manifest.results] == list(ops.OP_NAMES)
    assert all(r.status == "verified" and r.compiled_us and r.reference_us for r in manifest.results)
    assert manifest.torch_version and manifest.compiler and "-march=native" in manifest.flags
    on_disk = BuildManifest.model_validate_json(
        (Path(manifest.artifact).parent / "manifest-all.json").read_text())
    assert on_disk.cache_key == manifest.cache_key


def test_unchanged_rebuild_is_a_cache_hit(cpu_build):
    first, _ = cpu_build
    mtime = Path(first.artifact).stat().st_mtime_ns
    again = build(BuildRequest(arch="native", target="rms_norm", bench_iters=1, bench_hidden=256))
    assert again.cache_hit and again.compile_s == 0
    assert again.artifact == first.artifact and again.cache_key == first.cache_key
    assert Path(first.artifact).stat().st_mtime_ns == mtime


def test_load_cached_routes_ops_to_the_verified_build(cpu_build):
    loaded = load_cached(arch="native")
    assert sorted(loaded) == sorted(ops.OP_NAMES)
    for op in ops.OP_NAMES:
        assert ops.implementation(op) == f"tideflow_kernels.cpu.{op}"
    assert load_cached(arch="cpu") == {}  # nothing built for the portable arch


def test_starting_loads_the_build_of_its_own_sources_not_a_newer_one_of_other_sources(cpu_build):
    """A home keeps builds of other sources too (a release rolled back, flags tried). One of those, newer
    and verified, must not replace the build of the sources this process runs: here it is a library
    that does not even load, so picking it would leave every op on the reference."""
    manifest, _ = cpu_build
    other_key = "f" * len(manifest.cache_key)
    other_dir = Path(manifest.artifact).parent.with_name(other_key)
    other_dir.mkdir()
    try:
        artifact_path(other_dir, other_key).write_bytes(b"not a shared library")
        write_manifest(other_dir, manifest.model_copy(update={
            "cache_key": other_key, "artifact": str(artifact_path(other_dir, other_key)),
            "created_at": manifest.created_at + timedelta(hours=1)}))
        assert sorted(startup_ops("native", "cached")) == sorted(ops.OP_NAMES)
        assert all(ops.implementation(op) == f"tideflow_kernels.cpu.{op}" for op in ops.OP_NAMES)
    finally:
        shutil.rmtree(other_dir)


def test_broken_source_fails_naming_the_op_with_the_compiler_message(cpu_build, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SOURCE_DIR, src)
    header = src / "rotary_embedding.h"
    header.write_text(header.read_text().replace("const int64_t half = dim / 2;",
                                                 "const int64_t half = dim / 2 +;"))
    with pytest.raises(BuildFailed) as info:
        build(BuildRequest(arch="native", source_dir=src, activate=True, bench_iters=1, bench_hidden=256))
    failed = {r.op: r for r in info.value.manifest.results}
    assert "rotary_embedding: compile_failed: compile error" in str(info.value)
    assert "rotary_embedding.h" in failed["rotary_embedding"].message
    assert "error" in failed["rotary_embedding"].message
    assert "not built" in failed["rms_norm"].message
    assert all(ops.implementation(op) == "reference" for op in ops.OP_NAMES)


def test_wrong_result_fails_naming_the_op_and_keeps_the_reference(cpu_build):
    request = BuildRequest(arch="native", tolerances={"moe_experts": 0.0}, activate=True, bench_iters=1, bench_hidden=256)
    with pytest.raises(BuildFailed, match=r"moe_experts: wrong_result: .*relative error") as info:
        build(request)
    statuses = {r.op: r.status for r in info.value.manifest.results}
    assert statuses.pop("moe_experts") == "wrong_result"
    assert set(statuses.values()) == {"verified"}
    assert ops.implementation("moe_experts") == "reference"
    assert ops.implementation("rms_norm") == "tideflow_kernels.cpu.rms_norm"
    ops.use_reference()
    # The artifact's latest check of moe_experts failed, so the loader leaves it on the reference.
    assert "moe_experts" not in load_cached(arch="native")
    assert ops.implementation("moe_experts") == "reference"
    build(BuildRequest(arch="native", target="moe_experts", bench_iters=1, bench_hidden=256))  # passes again
    assert "moe_experts" in load_cached(arch="native")


@pytest.mark.parametrize(
    "field,kwargs",
    [("target", {"target": "softmax"}), ("arch", {"arch": "pentium"}), ("opt_level", {"opt_level": 4}),
     ("tolerances", {"tolerances": {"nope": 1.0}}), ("tolerances", {"tolerances": {"rms_norm": -1}})],
)
def test_bad_requests_fail_naming_the_field(field, kwargs):
    with pytest.raises(ValidationError, match=field):
        BuildRequest(**kwargs)


def test_same_key_built_into_two_homes_loads_both_in_one_process(cpu_build, tmp_path, monkeypatch):
    """The same sources built into a second TIDEFLOW_HOME in this process: a second library under its
    own namespace, not a second registration of the first one (which aborts the interpreter)."""
    first, first_impls = cpu_build
    monkeypatch.setenv("TIDEFLOW_HOME", str(tmp_path / "second-home"))
    second = build(BuildRequest(arch="native", target="rms_norm", bench_iters=1, bench_hidden=256))
    assert second.ok and not second.cache_hit and second.cache_key == first.cache_key
    assert Path(second.artifact).parent != Path(first.artifact).parent
    second_impls = implementations("cpu", Path(second.artifact), second.cache_key, ["rms_norm"])
    assert second_impls["rms_norm"] is not first_impls["rms_norm"]
    x, residual, w = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    want, _ = reference.rms_norm(x, w, 1e-6, residual)
    for fn in (first_impls["rms_norm"], second_impls["rms_norm"]):
        got, _ = fn(x, w, 1e-6, residual)
        torch.testing.assert_close(got, want)
