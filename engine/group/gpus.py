"""Which of this host's GPUs each local member owns.

A member that asks for GPUs (roles[].resources.gpus) gets its own, never shared with another member of
any group this backend runs: two DEP ranks on one host must not land on the same GPU, and a canary's
group must not land on the stable group's. The member sees only its GPUs (CUDA_VISIBLE_DEVICES), so
`--device cuda` in its command line is its first one. A group that needs more GPUs than are free is
refused before any of its members starts.
"""

from __future__ import annotations

import os
import threading

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


class GpuShortage(Exception):
    """The host has fewer free GPUs than a group asks for."""


def host_gpus() -> list[str]:
    """The GPUs this process may hand out: $CUDA_VISIBLE_DEVICES when set, else every GPU torch sees."""
    visible = os.environ.get(VISIBLE_ENV)
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


class GpuPool:
    """The host's GPUs, each free or owned by one member (keyed by the member's name)."""

    def __init__(self, gpus: list[str] | None = None) -> None:
        self._gpus = gpus  # None: discovered on first use, so hosts without GPUs never ask torch
        self._owner: dict[str, str] = {}  # gpu -> member name
        self._lock = threading.Lock()

    def _all(self) -> list[str]:
        if self._gpus is None:
            self._gpus = host_gpus()
        return self._gpus

    def free(self) -> list[str]:
        with self._lock:
            return [g for g in self._all() if g not in self._owner]

    def take(self, needs: dict[str, int]) -> dict[str, list[str]]:
        """GPUs for every member in `needs` (member name -> GPUs it asks for), all or none."""
        wanted = sum(needs.values())
        if not wanted:
            return {name: [] for name in needs}
        with self._lock:
            free = [g for g in self._all() if g not in self._owner]
            if wanted > len(free):
                raise GpuShortage(f"needs {wanted} GPUs, {len(free)} of this host's {len(self._all())} are free "
                                  f"(${VISIBLE_ENV} or torch.cuda.device_count() says which the backend may use)")
            out: dict[str, list[str]] = {}
            for name, count in needs.items():
                out[name], free = free[:count], free[count:]
                for g in out[name]:
                    self._owner[g] = name
            return out

    def hold(self, name: str, gpus: list[str]) -> None:
        """Mark `gpus` as `name`'s: an adopted member keeps the GPUs it was started with."""
        with self._lock:
            for g in gpus:
                self._owner[g] = name

    def give_back(self, names: set[str]) -> None:
        with self._lock:
            for g in [g for g, owner in self._owner.items() if owner in names]:
                del self._owner[g]
