"""Exceptions of the build pipeline; both carry what the caller should show the user."""

from __future__ import annotations

from tideflow_kernels.spec import BuildManifest


class CompileError(RuntimeError):
    """The compiler rejected the sources; the message is the compiler's own output."""


class BuildFailed(RuntimeError):
    """A build compiled wrong or computed wrong; names the ops and carries the manifest."""

    def __init__(self, manifest: BuildManifest):
        lines = [f"kernels build failed ({manifest.backend} {manifest.arch}):"]
        lines += [f"  {r.op}: {r.status}: {r.message}" for r in manifest.failures()]
        super().__init__("\n".join(lines))
        self.manifest = manifest


class KernelInputError(TypeError):
    """A compiled op was handed tensors it cannot compute on (another device, an unsupported dtype): a clear
    error instead of a crash or a wrong answer from raw pointers of the wrong memory."""
