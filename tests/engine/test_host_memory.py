"""Host memory for a KV cache sized as a fraction: MemAvailable describes the node, a container's cgroup limit the
room the process really has."""

from __future__ import annotations

from pathlib import Path

from engine.core.host_memory import available_bytes

GIB = 1 << 30


def host(tmp_path: Path, available_gib: int, cgroup: str) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal:  999999999 kB\nMemAvailable:  {available_gib * GIB // 1024} kB\n")
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    return tmp_path


def level(directory: Path, limit: str, usage: int, names=("memory.max", "memory.current")) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / names[0]).write_text(limit + "\n")
    (directory / names[1]).write_text(f"{usage}\n")


def test_a_pod_s_limit_caps_what_the_node_has_available(tmp_path):
    root = host(tmp_path, 100, "0::/kubepods/pod1/c1\n")
    level(root / "sys/fs/cgroup/kubepods/pod1/c1", "max", 1 * GIB)
    level(root / "sys/fs/cgroup/kubepods/pod1", str(4 * GIB), 1 * GIB)  # the pod's limit, one level up
    level(root / "sys/fs/cgroup/kubepods", "max", 50 * GIB)
    assert available_bytes(root) == 3 * GIB


def test_no_limit_leaves_mem_available(tmp_path):
    root = host(tmp_path, 100, "0::/\n")
    level(root / "sys/fs/cgroup", "max", 10 * GIB)
    assert available_bytes(root) == 100 * GIB
    v1 = host(tmp_path / "v1", 20, "4:memory:/job\n3:cpu:/\n")
    level(v1 / "sys/fs/cgroup/memory", str(2**63 - 4096), 0, ("memory.limit_in_bytes", "memory.usage_in_bytes"))
    assert available_bytes(v1) == 20 * GIB  # the job's own level is not mounted here; the root is unlimited


def test_a_cgroup_v1_limit_counts_too(tmp_path):
    root = host(tmp_path, 20, "4:memory:/job\n")
    level(root / "sys/fs/cgroup/memory/job", str(6 * GIB), 2 * GIB, ("memory.limit_in_bytes", "memory.usage_in_bytes"))
    assert available_bytes(root) == 4 * GIB
