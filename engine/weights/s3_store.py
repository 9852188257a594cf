"""S3-compatible store through boto3 (AWS S3, MinIO, Ceph RGW, moto).

Uploads use ChecksumAlgorithm=SHA256 with each part's ChecksumSHA256, so the server rejects a
part whose bytes do not hash to it and computes the object's composite checksum itself; that
composite is compared with ours on commit and by verify. Credentials come from the standard
AWS chain and are never read or logged here.
"""

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from engine.weights.config import S3StoreConfig
from engine.weights.errors import ChecksumMismatchError, ObjectMissingError, StoreError
from engine.weights.parts import sha256_b64, strip_part_count
from engine.weights.store import ListedObject, ObjectStore, StoredObject, StoredPart

_MISSING = {"404", "NoSuchKey", "NotFound"}


class S3Store(ObjectStore):
    """A version under `s3://bucket/prefix/`."""

    def __init__(self, config: S3StoreConfig):
        super().__init__(config, config.url)
        self.bucket = config.bucket
        self.prefix = config.prefix
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region,
            config=Config(
                max_pool_connections=config.max_concurrency + 4,
                retries={"mode": "standard", "max_attempts": config.max_attempts},
                connect_timeout=config.timeout_s,
                read_timeout=config.timeout_s,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    @contextmanager
    def _errors(self, what: str, key: str = "") -> Iterator[None]:
        """Turn boto errors into StoreError naming the object and the next step."""
        where = f"s3://{self.bucket}/{self.prefix}{key}"
        try:
            yield
        except NoCredentialsError:
            raise StoreError(
                f"{what} {where}: no AWS credentials found; set AWS_ACCESS_KEY_ID/"
                f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role"
            ) from None
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "?")
            if code == "NoSuchBucket":
                raise StoreError(f"{what} {where}: bucket {self.bucket} does not exist; create it first") from None
            raise StoreError(f"{what} {where} failed ({code}): {e.response.get('Error', {}).get('Message', '')}") from None
        except BotoCoreError as e:
            raise StoreError(f"{what} {where} failed: {e}; check the endpoint_url and the network") from None

    def head(self, key: str) -> StoredObject | None:
        with self._errors("head", key):
            try:
                resp = self.client.head_object(
                    Bucket=self.bucket, Key=self.prefix + key, ChecksumMode="ENABLED"
                )
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in _MISSING:
                    return None
                raise
        checksum = resp.get("ChecksumSHA256")
        digest, parts = strip_part_count(checksum) if checksum else (None, None)
        return StoredObject(size=resp["ContentLength"], sha256=digest, parts=parts)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if length == 0:
            return b""
        with self._errors("read", key):
            try:
                resp = self.client.get_object(
                    Bucket=self.bucket, Key=self.prefix + key, Range=f"bytes={start}-{start + length - 1}"
                )
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in _MISSING:
                    raise ObjectMissingError(self.url, key) from None
                raise
            data = resp["Body"].read()
        self.counters.downloaded(len(data))
        return data

    def read_bytes(self, key: str) -> bytes | None:
        with self._errors("read", key):
            try:
                return self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in _MISSING:
                    return None
                raise

    def write_bytes(self, key: str, data: bytes) -> None:
        with self._errors("write", key):
            self.client.put_object(
                Bucket=self.bucket, Key=self.prefix + key, Body=data,
                ChecksumAlgorithm="SHA256", ChecksumSHA256=sha256_b64(data),
            )

    def delete(self, key: str) -> None:
        with self._errors("delete", key):
            self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key)

    def list_objects(self, prefix: str) -> Iterator[ListedObject]:
        with self._errors("list", prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
            for page in pages:
                for item in page.get("Contents", []):
                    yield ListedObject(item["Key"][len(self.prefix):], item["Size"], item["LastModified"].timestamp())

    def expire_prefix(self, prefix: str, days: int) -> bool:
        """One lifecycle rule per prefix, named after it; the bucket's other rules are kept (S3 replaces the whole
        configuration on every put)."""
        rule_id = "tideflow-expire-" + hashlib.sha256((self.prefix + prefix).encode()).hexdigest()[:16]
        with self._errors("lifecycle", prefix):
            try:
                rules = self.client.get_bucket_lifecycle_configuration(Bucket=self.bucket)["Rules"]
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") != "NoSuchLifecycleConfiguration":
                    raise
                rules = []
            rules = [r for r in rules if r.get("ID") != rule_id]
            rules.append({"ID": rule_id, "Status": "Enabled", "Filter": {"Prefix": self.prefix + prefix},
                          "Expiration": {"Days": days}})
            self.client.put_bucket_lifecycle_configuration(Bucket=self.bucket, LifecycleConfiguration={"Rules": rules})
        return True

    def _uploads(self, key: str) -> list[dict]:
        found: list[dict] = []
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self.prefix + key
        )
        for page in pages:
            found += [u for u in page.get("Uploads", []) if u["Key"] == self.prefix + key]
        return found

    def open_upload(self, key: str) -> str | None:
        with self._errors("list uploads of", key):
            uploads = self._uploads(key)
        # Servers list uploads oldest first; on equal timestamps keep that order.
        return max(enumerate(uploads), key=lambda iu: (iu[1]["Initiated"], iu[0]))[1]["UploadId"] if uploads else None

    def start_upload(self, key: str) -> str:
        with self._errors("start upload of", key):
            resp = self.client.create_multipart_upload(
                Bucket=self.bucket, Key=self.prefix + key, ChecksumAlgorithm="SHA256"
            )
        return resp["UploadId"]

    def list_parts(self, key: str, upload_id: str) -> dict[int, StoredPart]:
        found: dict[int, StoredPart] = {}
        with self._errors("list parts of", key):
            pages = self.client.get_paginator("list_parts").paginate(
                Bucket=self.bucket, Key=self.prefix + key, UploadId=upload_id
            )
            for page in pages:
                for p in page.get("Parts", []):
                    found[p["PartNumber"]] = StoredPart(
                        number=p["PartNumber"], size=p["Size"],
                        sha256=p.get("ChecksumSHA256"), etag=p.get("ETag"),
                    )
        return found

    def part_matches(
        self, key: str, upload_id: str, part: StoredPart, offset: int, data: bytes, sha256: str
    ) -> bool:
        if part.size != len(data):
            return False
        if part.sha256 is not None:
            return part.sha256 == sha256
        # Servers that do not list part checksums (moto) still give the part's MD5 as its ETag.
        return part.etag is not None and part.etag.strip('"') == hashlib.md5(data, usedforsecurity=False).hexdigest()

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: bytes, sha256: str,
        source_fd: int | None = None,
    ) -> StoredPart:
        with self._errors(f"upload part {number} of", key):
            resp = self.client.upload_part(
                Bucket=self.bucket, Key=self.prefix + key, UploadId=upload_id,
                PartNumber=number, Body=data, ChecksumSHA256=sha256,
            )
        self.counters.uploaded(len(data))
        return StoredPart(number=number, size=len(data), sha256=sha256, etag=resp["ETag"])

    def complete_upload(
        self, key: str, upload_id: str, parts: list[StoredPart], composite: str
    ) -> None:
        with self._errors("complete upload of", key):
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=self.prefix + key, UploadId=upload_id,
                MultipartUpload={"Parts": [
                    {"PartNumber": p.number, "ETag": p.etag, "ChecksumSHA256": p.sha256} for p in parts
                ]},
            )
            stale = [u["UploadId"] for u in self._uploads(key)]
        for other in stale:
            self.abort_upload(key, other)
        stored = self.head(key)
        if stored is None or stored.sha256 != composite:
            raise ChecksumMismatchError(
                key, f"the store computed composite SHA-256 {stored.sha256 if stored else None}, "
                f"expected {composite}", "publish again with --force",
            )

    def abort_upload(self, key: str, upload_id: str) -> None:
        with self._errors("abort upload of", key):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.prefix + key, UploadId=upload_id)
