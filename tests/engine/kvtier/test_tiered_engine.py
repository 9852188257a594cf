"""An engine with KV tiers: the same greedy tokens as without them, blocks loaded from host memory, disk and a shared
S3 store (moto's server over HTTP), a corrupt block or a stopped store recomputed with no failed request, and no
block crossing a version or a cache salt."""

from __future__ import annotations

import random

import boto3
import pytest

from engine.core.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.kvtier.config import KVTierConfig
from engine.kvtier.tiered import KVTierError
from engine.model.config import read_config
from engine.model.paged import kv_bytes_per_block
from harness.moto import start_moto

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

BLOCK = 16
POOL_BLOCKS = 24  # two prompts of 15 blocks do not fit: the second evicts the first
HOST_FEW = 80 << 10  # host memory for about 9 tiny-model blocks: the rest must come from disk or the store


@pytest.fixture(scope="module")
def block_bytes(tiny_model_dir) -> int:
    return kv_bytes_per_block(read_config(tiny_model_dir, None), BLOCK)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(3, 500) for _ in range(160)]
    return [system + [rng.randrange(3, 500) for _ in range(80)] for _ in range(6)]


def engine(model_dir, block_bytes, tiers: KVTierConfig | None, version: str = "v1") -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=block_bytes * POOL_BLOCKS, block_size=BLOCK, kv_tiers=tiers, version=version)
    eng = LLMEngine.from_dir(model_dir, config)
    eng.start()
    return eng


def serve_twice(eng: LLMEngine, prompts, salt: str | None = None) -> list[tuple[list[int], int]]:
    """Each prompt twice, in turn: the second pass finds its blocks evicted from the pool."""
    out = []
    for _ in range(2):
        for prompt in prompts:
            result = eng.generate([prompt], SamplingParams(max_tokens=6, cache_salt=salt))[0]
            assert result.finish_reason == "length", result
            out.append((result.token_ids, result.cached_tokens))
    return out


def tier_value(eng: LLMEngine, name: str, tier: str, **labels: str) -> float:
    return eng.metrics.value(f"tideflow_kv_tier_{name}", tier=tier, **labels)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, block_bytes, prompts):
    eng = engine(tiny_model_dir, block_bytes, None)
    try:
        return serve_twice(eng, prompts)
    finally:
        eng.stop()


def test_host_memory_serves_evicted_blocks_with_the_same_tokens(tiny_model_dir, block_bytes, prompts, reference):
    eng = engine(tiny_model_dir, block_bytes, KVTierConfig(host_bytes=64 << 20))
    try:
        served = serve_twice(eng, prompts)
        assert [t for t, _ in served] == [t for t, _ in reference]
        assert sum(c for _, c in served) > sum(c for _, c in reference)
        assert tier_value(eng, "onboard_blocks_total", "host") > 0
        assert tier_value(eng, "hit_tokens_total", "host") > 0
    finally:
        eng.stop()


def test_disk_serves_what_host_memory_dropped(tiny_model_dir, block_bytes, prompts, reference, tmp_path):
    tiers = KVTierConfig(host_bytes=HOST_FEW, disk_path=str(tmp_path / "kv"))
    eng = engine(tiny_model_dir, block_bytes, tiers)
    try:
        served = serve_twice(eng, prompts)
        assert [t for t, _ in served] == [t for t, _ in reference]
        assert tier_value(eng, "onboard_blocks_total", "disk") > 0
        assert tier_value(eng, "fallbacks_total", "disk", reason="corrupt") == 0
    finally:
        eng.stop()


def test_a_corrupt_disk_block_is_recomputed(tiny_model_dir, block_bytes, prompts, reference, tmp_path):
    root = tmp_path / "kv"
    first = engine(tiny_model_dir, block_bytes, KVTierConfig(host_bytes=HOST_FEW, disk_path=str(root)))
    try:
        serve_twice(first, prompts)
    finally:
        first.stop()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    assert files
    for path in files:  # every block on disk damaged: a restarted member must recompute them all
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    second = engine(tiny_model_dir, block_bytes, KVTierConfig(host_bytes=HOST_FEW, disk_path=str(root)))
    try:
        served = serve_twice(second, prompts)
        assert [t for t, _ in served] == [t for t, _ in reference]
        assert served[0][1] == 0, "the first prompt's blocks were all damaged: none may be read"
        assert tier_value(second, "fallbacks_total", "disk", reason="corrupt") > 0
        assert second.metrics.value("tideflow_requests_total", status="error") == 0
    finally:
        second.stop()


@pytest.fixture
def bucket(s3_endpoint) -> str:
    name = f"kv-{random.randrange(1 << 30):08x}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


def store_tiers(bucket: str) -> KVTierConfig:
    return KVTierConfig(host_bytes=HOST_FEW, store_url=f"s3://{bucket}/fleet/", store_min_uses=1)


def test_a_second_member_loads_the_first_ones_blocks_from_the_store(tiny_model_dir, block_bytes, prompts, reference,
                                                                    bucket):
    writer = engine(tiny_model_dir, block_bytes, store_tiers(bucket))
    try:
        serve_twice(writer, prompts)
    finally:
        writer.stop()  # after what it queued reached the store
    assert writer.metrics.value("tideflow_kv_tier_offload_blocks_total", tier="store") > 0
    reader = engine(tiny_model_dir, block_bytes, store_tiers(bucket))
    try:
        first = reader.generate([prompts[0]], SamplingParams(max_tokens=6))[0]
        assert first.token_ids == reference[0][0]
        assert first.cached_tokens > 0 and tier_value(reader, "hit_tokens_total", "store") > 0
    finally:
        reader.stop()


def test_a_canary_version_and_another_salt_never_read_the_stable_blocks(tiny_model_dir, block_bytes, prompts, bucket):
    """Each reader is fresh, as the reader of the test above that finds the blocks (before its first long step no
    prefill cost is known, and loading is tried)."""
    stable = engine(tiny_model_dir, block_bytes, store_tiers(bucket))
    try:
        serve_twice(stable, prompts)
    finally:
        stable.stop()
    canary = engine(tiny_model_dir, block_bytes, store_tiers(bucket), version="v2")
    try:
        assert canary.generate([prompts[0]], SamplingParams(max_tokens=6))[0].cached_tokens == 0
        assert tier_value(canary, "hit_tokens_total", "store") == 0
    finally:
        canary.stop()
    tenant = engine(tiny_model_dir, block_bytes, store_tiers(bucket))
    try:
        salted = tenant.generate([prompts[0]], SamplingParams(max_tokens=6, cache_salt="tenant-b"))[0]
        assert salted.cached_tokens == 0 and tier_value(tenant, "hit_tokens_total", "store") == 0
    finally:
        tenant.stop()


def test_a_stopped_store_costs_recompute_not_requests(tiny_model_dir, block_bytes, prompts, reference, tmp_path,
                                                     s3_endpoint, monkeypatch):
    server, endpoint = start_moto(tmp_path / "moto.log", timeout_s=60)
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="doomed")
        monkeypatch.setenv("TIDEFLOW_S3_ENDPOINT_URL", endpoint)
        eng = engine(tiny_model_dir, block_bytes, KVTierConfig(host_bytes=HOST_FEW, store_url="s3://doomed/kv/",
                                                               store_min_uses=1, store_timeout_s=1.0))
    finally:
        server.stop()
    try:
        served = serve_twice(eng, prompts)  # every store read and write now fails
        assert [t for t, _ in served] == [t for t, _ in reference]
        failures = tier_value(eng, "fallbacks_total", "store", reason="unavailable") + \
            tier_value(eng, "write_errors_total", "store")
        assert failures > 0
        assert eng.metrics.value("tideflow_requests_total", status="error") == 0
    finally:
        eng.stop()


def test_unusable_tiers_are_refused_at_startup(tiny_model_dir, block_bytes, tmp_path, s3_endpoint):
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(KVTierError, match="disk_path"):
        engine(tiny_model_dir, block_bytes, KVTierConfig(host_bytes=1 << 20, disk_path=str(tmp_path / "a-file")))
    with pytest.raises(KVTierError, match="store_url"):
        engine(tiny_model_dir, block_bytes, KVTierConfig(host_bytes=1 << 20, store_url="s3://no-such-bucket-kv/x/",
                                                         store_timeout_s=1.0))
    with pytest.raises(KVTierError, match="store_url ftp://"):
        engine(tiny_model_dir, block_bytes, KVTierConfig(host_bytes=1 << 20, store_url="ftp://somewhere/kv/"))
