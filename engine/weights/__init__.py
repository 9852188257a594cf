"""Model weights: publish to an object store, verify against a manifest, pull into a node cache."""

from engine.weights.errors import (
    ChecksumMismatchError,
    ManifestInvalidError,
    ManifestMissingError,
    ObjectMissingError,
    StoreError,
    UnverifiedWeightsError,
    VersionConflictError,
    WeightsError,
)
from engine.weights.manifest import Manifest, ManifestFile
from engine.weights.publish import PublishReport, publish
from engine.weights.pull import PullReport, cache_dir_for, local_model_dir, pull, require_verified
from engine.weights.urls import default_store_url, open_store
from engine.weights.verify import VerifyReport, verify

__all__ = [
    "ChecksumMismatchError",
    "Manifest",
    "ManifestFile",
    "ManifestInvalidError",
    "ManifestMissingError",
    "ObjectMissingError",
    "PublishReport",
    "PullReport",
    "StoreError",
    "UnverifiedWeightsError",
    "VerifyReport",
    "VersionConflictError",
    "WeightsError",
    "cache_dir_for",
    "local_model_dir",
    "default_store_url",
    "open_store",
    "publish",
    "pull",
    "require_verified",
    "verify",
]
