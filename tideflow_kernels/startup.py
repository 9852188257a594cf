"""What a serving process computes with: the verified compiled ops for the current kernel sources, built at
start when missing, so `serve` is never slow without saying so.

`auto` (the default, or $TIDEFLOW_KERNELS): when no build of the current sources, flags, torch and arch is
cached yet, compile, verify and cache it (the first start on a host pays about 20-40 s; every later one
loads it), then route every verified op to it. The processes of one home build under one lock, so a group
starting several members compiles once. `cached`: use whatever verified build is cached, build nothing.
`reference`: torch's own ops only. Ops that fail to compile or verify stay on the reference, logged.
"""

from __future__ import annotations

import fcntl
import logging
import os
from contextlib import contextmanager
from typing import Callable

import torch

from tideflow_kernels import cache, ops
from tideflow_kernels.build import build, cache_key_of
from tideflow_kernels.errors import BuildFailed
from tideflow_kernels.loader import load_cached
from tideflow_kernels.spec import KERNEL_MODES, KERNELS_ENV, BuildRequest, backend_of

log = logging.getLogger(__name__)


def arch_for(device: torch.device) -> str:
    """The kernel build a device computes with: the host's own CPU (`native`) or the GPU's `sm_XY`."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor}"
    return "native"


def startup_ops(arch: str = "native", mode: str | None = None,
                progress: Callable[[str], None] | None = None) -> dict[str, Callable]:
    """Route the ops per `mode` (None: $TIDEFLOW_KERNELS, else auto); returns the compiled ones in use."""
    mode = mode or os.environ.get(KERNELS_ENV) or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels mode {mode!r}: choose one of {', '.join(KERNEL_MODES)} "
                         f"(flag --kernels or ${KERNELS_ENV})")
    if mode == "reference":
        log.info("kernels: torch reference ops only (--kernels reference)")
        return {}
    request = BuildRequest(target="all", arch=arch, bench_iters=1)
    key = cache_key_of(request)  # the build of these sources, never a newer or older one in the same home
    if mode == "auto":
        _build_once(request, key, progress or (lambda msg: log.info("kernels: %s", msg)))
    loaded = load_cached(arch, key)
    reference = [op for op in ops.OP_NAMES if op not in loaded]
    log.info("kernels: compiled %s ops: %s%s", arch, ", ".join(sorted(loaded)) or "none",
             f"; torch reference for {', '.join(reference)}" if reference else "")
    return loaded


def _build_once(request: BuildRequest, key: str, say: Callable[[str], None]) -> None:
    """Build the current sources unless a build of them is cached (a failed one too: it is not retried on
    every start; `tideflow kernels build` retries it)."""
    backend = backend_of(request.arch)
    with _lock(backend, request.arch):
        if any(m.cache_key == key and m.target == "all" for m in cache.read_manifests(backend, request.arch)):
            return
        say(f"no build of the current kernel sources for {request.arch} yet: compiling and verifying once (cached)")
        try:
            build(request, progress=say)
        except BuildFailed as exc:  # the ops that failed stay on the reference; the rest are used
            log.warning("kernels: %s", exc)


@contextmanager
def _lock(backend: str, arch: str):
    """One builder at a time per home, backend and arch; the others wait, then find its build."""
    path = cache.kernels_root() / f"{backend}-{arch}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
