"""Helpers shared by the benchmark scripts: tables, the host's name (CPU, cores, AMX or not) and the machine's
memory copy bandwidth."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from engine.group.groupset import LocalGroupSet
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup


def copy_bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """Best-of-n large tensor copy rate (read + write bytes per second): the memory roofline."""
    src = torch.empty(mbytes * 2**20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best / 1e9


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [headers] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def host() -> str:
    """CPU model, cores and whether it has AMX (from /proc/cpuinfo's flags)."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    amx = "AMX" if any(f.startswith("amx") for f in flags) else "no AMX"
    return f"{model}, {os.cpu_count()} cores, {amx}"


def pd_group_up(gs: LocalGroupSet, model_dir: Path, engine: dict, name: str = "pd"):
    """A group of 1 prefill + 1 decode member on `gs`, each with `engine`'s knobs, once it is Ready; SystemExit
    naming why when it fails to get there."""
    spec = InferenceGroup.model_validate({"name": name, "version": "v1", "model": {"path": str(model_dir)},
                                          "roles": [{"role": "prefill", "engine": engine},
                                                    {"role": "decode", "engine": engine}]})
    group = gs.up(spec)
    if group.wait_for({GroupState.READY, GroupState.FAILED}, 600) != GroupState.READY:
        raise SystemExit(f"group {name} did not get ready: {group.status.events[-1].message}")
    return group
