"""Host memory a process may still take: MemAvailable of /proc/meminfo, or less when the process's cgroup caps it.

In a container /proc/meminfo describes the node, not the pod: a CPU member sizing its KV cache as a fraction of
MemAvailable on a 512 GiB node under a 4 GiB limit would size it past the limit and be OOM-killed. So the room
left under every memory limit on the way from the process's cgroup to the root counts too (cgroup v2's
memory.max - memory.current, v1's memory.limit_in_bytes - memory.usage_in_bytes).
"""

from __future__ import annotations

from pathlib import Path

UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def available_bytes(root: Path = Path("/")) -> int:
    """MemAvailable, capped by the room under the process's cgroup memory limits."""
    fields = dict(line.split(":", 1) for line in (root / "proc/meminfo").read_text().splitlines() if ":" in line)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    rooms = [room for room in _cgroup_rooms(root) if room is not None]
    return min([available, *rooms])


def _cgroup_rooms(root: Path):
    """Room left under each memory limit from this process's cgroup up to the hierarchy's root."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base, limit, usage = root / "sys/fs/cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit, usage = root / "sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        here = base / path.lstrip("/")
        for directory in [here, *here.parents]:
            if directory != base and base not in directory.parents:
                break
            yield _room(directory / limit, directory / usage)


def _room(limit_file: Path, usage_file: Path) -> int | None:
    try:
        limit, usage = limit_file.read_text().strip(), usage_file.read_text().strip()
    except OSError:
        return None  # this level is not mounted here (a container sees its own cgroup as the root)
    if limit == "max" or not limit.isdigit() or int(limit) >= UNLIMITED or not usage.isdigit():
        return None
    return max(0, int(limit) - int(usage))
