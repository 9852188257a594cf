"""Errors of the weights subsystem; each message names the file and what to do next.

`ChecksumMismatchError` is deliberately its own branch: corrupt bytes do not heal on retry,
so callers (the Prefect tasks) retry `StoreError` but never a checksum mismatch.
"""


class WeightsError(Exception):
    """Base of every error raised by engine.weights."""


class StoreError(WeightsError):
    """The object store could not be reached or refused a request (worth retrying)."""


class ManifestMissingError(WeightsError):
    """No manifest.json at the URL: the version was never published or is still being published."""

    def __init__(self, url: str):
        super().__init__(
            f"no manifest.json at {url}: the version is not published (or its publish has not "
            f"finished); publish it with `tideflow weights publish DIR --to {url}`"
        )
        self.url = url


class ManifestInvalidError(WeightsError):
    """manifest.json exists but is not a valid tideflow manifest."""

    def __init__(self, where: str, reason: str):
        super().__init__(
            f"manifest.json at {where} is not a valid tideflow manifest ({reason}); "
            f"republish the version with --force"
        )
        self.where = where


class ObjectMissingError(WeightsError):
    """The manifest lists a file the store does not hold."""

    def __init__(self, url: str, path: str):
        super().__init__(
            f"{path} is listed in the manifest at {url} but the store has no such object; "
            f"the version is damaged: republish it with --force"
        )
        self.url = url
        self.path = path


class ChecksumMismatchError(WeightsError):
    """Bytes do not match the manifest (size or SHA-256); never retried."""

    def __init__(self, path: str, detail: str, action: str):
        super().__init__(f"checksum mismatch in {path}: {detail}; {action}")
        self.path = path
        self.detail = detail


class VersionConflictError(WeightsError):
    """The destination already holds this version with other content."""

    def __init__(self, url: str, path: str, detail: str):
        super().__init__(
            f"{url} already holds a published version whose {path} differs ({detail}); "
            f"publish under a new version, or pass --force to overwrite it"
        )
        self.url = url
        self.path = path


class UnverifiedWeightsError(WeightsError):
    """A weights directory is not a verified cache; the engine refuses to load from it."""

    def __init__(self, directory: str, reason: str):
        super().__init__(
            f"weights in {directory} are not verified ({reason}); "
            f"run `tideflow weights pull URL --cache {directory}` first"
        )
        self.directory = directory
