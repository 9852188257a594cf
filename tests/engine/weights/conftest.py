"""Fixtures: a small checkpoint, and a version URL parametrized over both stores (S3 through the moto server of
tests/conftest.py, and the filesystem)."""

import itertools
import json
import os
import shutil
import uuid
from pathlib import Path

import boto3
import pytest

from engine.weights.config import MiB
from engine.weights.parts import part_ranges
from engine.weights.urls import open_store

PART = 5 * MiB  # S3's minimum part size; small files keep the suite fast
CONCURRENCY = 3


def make_checkpoint(root: Path) -> Path:
    """A safetensors-like checkpoint: two shards (3 and 2 parts of 5 MiB), config, tokenizer."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "tiny-moe", "hidden_size": 64}))
    (root / "model-00001-of-00002.safetensors").write_bytes(os.urandom(11_000_000))
    (root / "model-00002-of-00002.safetensors").write_bytes(os.urandom(6_000_000))
    (root / "tokenizer.json").write_bytes(os.urandom(3000))
    return root


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """Shared read-only checkpoint; tests that change it copy it first."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture
def total_parts(checkpoint) -> int:
    """Parts the checkpoint splits into at PART bytes (7: 1 + 3 + 2 + 1)."""
    return sum(len(part_ranges(p.stat().st_size, PART)) for p in checkpoint.iterdir())


@pytest.fixture
def own_checkpoint(checkpoint, tmp_path) -> Path:
    dest = tmp_path / "own-ckpt"
    shutil.copytree(checkpoint, dest)
    return dest


class Backend:
    """A fresh version location in one store kind, plus a way to corrupt what it stores."""

    def __init__(self, kind: str, url: str, endpoint: str | None, bucket: str | None, root: Path | None):
        self.kind, self.url, self.endpoint, self.bucket, self.root = kind, url, endpoint, bucket, root

    part_size = PART
    concurrency = CONCURRENCY

    def store(self):
        return open_store(self.url, part_size=PART, max_concurrency=CONCURRENCY)

    def flip_byte(self, rel: str, offset: int) -> None:
        if self.kind == "fs":
            with open(self.root / rel, "r+b") as f:
                f.seek(offset)
                b = f.read(1)
                f.seek(offset)
                f.write(bytes([b[0] ^ 0xFF]))
            return
        client = boto3.client("s3", endpoint_url=self.endpoint)
        key = self.url.removeprefix(f"s3://{self.bucket}/") + rel
        data = bytearray(client.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        data[offset] ^= 0xFF
        client.put_object(Bucket=self.bucket, Key=key, Body=bytes(data))


_counter = itertools.count()


@pytest.fixture(params=["s3", "fs"])
def backend(request, tmp_path) -> Backend:
    if request.param == "fs":
        root = tmp_path / "store" / "models" / "tiny" / "v1"
        return Backend("fs", root.as_uri() + "/", None, None, root)
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"weights-{next(_counter)}-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return Backend("s3", f"s3://{bucket}/models/tiny/v1/", endpoint, bucket, None)
