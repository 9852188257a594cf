"""The shared store's bounds: a directory loses exactly its expired blocks, an S3 bucket gets a lifecycle rule on
the KV keys (beside its other rules), and a version's blocks go with it."""

from __future__ import annotations

import os
import random
import time

import boto3
import pytest

from engine.kvtier.expiry import remove_version, sweep

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

DAY = 86400


def put(root, key: str, size: int, age_s: float = 0.0) -> None:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"k" * size)
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))


def test_a_directory_store_loses_exactly_its_expired_blocks(tmp_path):
    put(tmp_path, "kv/default/v1/s/old1", 100, age_s=2 * DAY)
    put(tmp_path, "kv/default/v2/s/old2", 50, age_s=1.5 * DAY)
    put(tmp_path, "kv/default/v1/s/fresh", 70, age_s=3600)
    put(tmp_path, "models/default/v1/weights.bin", 10, age_s=5 * DAY)  # not KV: never touched
    report = sweep(tmp_path.as_uri() + "/", ttl_s=DAY)
    assert (report.lifecycle, report.objects_deleted, report.bytes_freed) == (False, 2, 150)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["kv/default/v1/s/fresh", "models/default/v1/weights.bin"]


def test_a_version_s_blocks_are_removed_and_no_other_version_s(tmp_path):
    put(tmp_path, "kv/default/v1/s1/a", 10)
    put(tmp_path, "kv/default/v1/s2/b", 20)
    put(tmp_path, "kv/default/v10/s1/a", 40)
    report = remove_version(tmp_path.as_uri() + "/", "default", "v1")
    assert (report.objects_deleted, report.bytes_freed) == (2, 30)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["a"]


@pytest.fixture
def bucket(s3_endpoint) -> str:
    name = f"kv-expiry-{random.randrange(1 << 30):08x}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


def test_an_s3_store_expires_its_kv_by_a_lifecycle_rule_kept_beside_the_others(s3_endpoint, bucket):
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    other = {"ID": "logs", "Status": "Enabled", "Filter": {"Prefix": "logs/"}, "Expiration": {"Days": 30}}
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [other]})
    s3.put_object(Bucket=bucket, Key="fleet/kv/default/v1/s/a", Body=b"x")
    for _ in range(2):  # idempotent: one rule for the prefix however often the pipeline runs
        report = sweep(f"s3://{bucket}/fleet/", ttl_s=1.5 * DAY)
        assert report.lifecycle and report.objects_deleted == 0
    rules = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    ours = [r for r in rules if r["ID"] != "logs"]
    assert len(rules) == 2 and len(ours) == 1
    assert ours[0]["Filter"]["Prefix"] == "fleet/kv/" and ours[0]["Expiration"]["Days"] == 2
    assert s3.list_objects_v2(Bucket=bucket)["KeyCount"] == 1  # the rule deletes, later, not the sweep
