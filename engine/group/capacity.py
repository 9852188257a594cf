"""Does a group fit this host's memory? The local backend asks before it starts any member (issue #37 item 4).

Started anyway, members that do not fit make the host swap or the kernel OOM-kill them, which reads as a crash
loop. So the local backend estimates what each new member will hold once loaded and serving, adds what the
members it runs have still to take, and refuses the group when that exceeds the host's available memory.
Kubernetes needs none of this: its scheduler places pods by their memory requests.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError, safe_open

from engine.core.engine_config import DEFAULT_KV_FRACTION
from engine.encoder.prompt import VISION_SUBDIR
from engine.runtime.errors import CheckpointError
from engine.group.spec import InferenceGroup, Member, RoleSpec
from engine.model.config import read_config

# Anonymous memory (RssAnon) of one `tideflow serve` process beyond its weights and KV cache: the interpreter,
# torch, the HTTP server, the tokenizer and what warm-up leaves allocated. Measured by starting one colocated
# member through LocalProcessBackend with kv_cache_bytes 16,000,000 (as the tests start members;
# TIDEFLOW_KERNELS=cached), reading RssAnon of /proc/<pid>/status 1 s after it was Ready and subtracting the
# weights' and the KV cache's bytes: 316 MB on the tiny model (TINY_CONFIG; 325 MB RssAnon, three runs) and 321 MB
# on the default model (780 MB, two runs), but 468 MB (923 MB) for the default model's first member in a fresh
# TIDEFLOW_HOME (two runs). The worst reading, rounded up: an estimate that refuses is cheaper than an OOM kill.
MEMBER_OVERHEAD_BYTES = 480_000_000
# Each API server process in front of an engine core in a process of its own (`engine_core: process`): the same
# measurement, summed over the member's processes, read 174 MB more with api_server_count 1 and 2 x 160 MB with 2.
API_SERVER_OVERHEAD_BYTES = 175_000_000


class CapacityCheck(BaseModel):
    """The local backend's host memory check."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(True, description="refuse a group whose members would not fit this host's available memory, "
                                            "before any of them starts; off: start them anyway (`tideflow controller "
                                            "--no-capacity-check`, for an operator who knows the estimate is too high)")
    mem_available_bytes: int | None = Field(
        None, gt=0, description="the memory this backend's members may hold in all (a budget: what the running ones "
                                "hold counts against it); None: MemAvailable of /proc/meminfo at each start, less what "
                                "the running members have still to take")


class MemoryShortage(Exception):
    """The members a group asks for would not fit this host's available memory."""


class MemberNeed(BaseModel):
    """What one member will hold in host memory once loaded and serving, in bytes."""

    model_config = ConfigDict(frozen=True)

    weights: int = Field(ge=0, description="its weights in host memory (0 on GPUs)")
    kv_cache: int = Field(ge=0, description="its KV cache in host memory (0 on GPUs and for an encoder)")
    processes: int = Field(ge=0, description="the measured overhead of its processes")

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.processes

    def describe(self) -> str:
        return (f"{_size(self.total)} (weights {_size(self.weights)}, KV cache {_size(self.kv_cache)}, "
                f"processes {_size(self.processes)})")


def member_need(group: InferenceGroup, spec: RoleSpec, model_dir: str, mem_available: int) -> MemberNeed:
    """One member of `spec`: weights + KV cache + processes, an upper bound.

    A member with GPUs keeps its weights and KV cache on them: the host holds its processes only. A
    kv_cache_fraction is of the MemAvailable the member finds once its weights are loaded
    (engine.core.host_memory.available_bytes): at most `mem_available` (now) less its own weights and processes;
    members loading beside it leave it less.
    """
    e = spec.engine
    processes = MEMBER_OVERHEAD_BYTES + (e.api_server_count * API_SERVER_OVERHEAD_BYTES
                                         if e.engine_core == "process" else 0)
    if spec.resources.gpus:
        return MemberNeed(weights=0, kv_cache=0, processes=processes)
    if spec.role == "encoder":  # the vision encoder alone, and no KV cache
        return MemberNeed(weights=_file_bytes(Path(model_dir) / VISION_SUBDIR), kv_cache=0, processes=processes)
    weights = weight_bytes(model_dir, group.model.dtype, spec.members_per_instance)
    if e.kv_cache_bytes is not None:
        kv = e.kv_cache_bytes
    else:
        kv = int((e.kv_cache_fraction or DEFAULT_KV_FRACTION) * max(0, mem_available - weights - processes))
    return MemberNeed(weights=weights, kv_cache=kv, processes=processes)


def weight_bytes(model_dir: str, dtype: str | None, ranks: int) -> int:
    """Bytes of the weights one of `ranks` DEP ranks loads: every tensor in the dtype it is served in, the
    experts split over the ranks. Read from the safetensors headers (no tensor is read). An unreadable
    checkpoint counts 0: the member's own load names what is wrong with it."""
    try:
        itemsize = read_config(model_dir, dtype).torch_dtype.itemsize
        dense = experts = 0
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(path), "pt") as handle:
                for name in handle.keys():
                    numel = math.prod(handle.get_slice(name).get_shape())
                    if ".experts." in name:
                        experts += numel
                    else:
                        dense += numel
    except (CheckpointError, SafetensorError, OSError, ValueError):
        return 0
    return itemsize * (dense + math.ceil(experts / ranks))


def _file_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def held_bytes(roots: set[int]) -> dict[int, int]:
    """Anonymous memory each root process holds with its descendants (a member's engine core and API servers).

    Anonymous only: file pages (the checkpoint it read, libraries) are page cache, which MemAvailable counts as
    available."""
    children: dict[int, list[int]] = defaultdict(list)
    anon: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = dict(line.split(":", 1) for line in Path(entry.path, "status").read_text().splitlines())
        except (OSError, ValueError):
            continue  # gone meanwhile
        pid = int(entry.name)
        children[int(status["PPid"])].append(pid)
        anon[pid] = int(status.get("RssAnon", "0 kB").split()[0]) * 1024  # kernel threads have none
    held = {}
    for root in roots:
        total, stack = 0, [root]
        while stack:
            pid = stack.pop()
            total += anon.get(pid, 0)
            stack.extend(children.get(pid, ()))
        held[root] = total
    return held


def check_fits(new: dict[Member, MemberNeed], taken: int, available: int, check: CapacityCheck) -> None:
    """Raise MemoryShortage when the `new` members need more than `available` less what the members running take
    of it (`taken`); the message names the need, the memory available and the largest member."""
    need = sum(n.total for n in new.values())
    if not new or need + taken <= available:
        return
    largest, most = max(new.items(), key=lambda kv: kv[1].total)
    source = "capacity_check.mem_available_bytes" if check.mem_available_bytes else \
        "MemAvailable of /proc/meminfo, under this process's cgroup memory limits"
    members = f"{len(new)} member{'s' if len(new) > 1 else ''}"
    running = f", less {_size(taken)} that the members running here take" if taken else ""
    raise MemoryShortage(
        f"needs {_size(need)} of host memory for {members}, but {_size(max(0, available - taken))} is free for them "
        f"({source} {_size(available)}{running}); the largest, "
        f"{largest.role} {largest.instance}/{largest.rank}, needs {most.describe()}. Lower "
        "roles[].engine.kv_cache_bytes (or kv_cache_fraction) or instances, stop another group, or start the "
        "controller with --no-capacity-check")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
