"""`TIDEFLOW_NO_AMX=1`: compute as a host without AMX tiles would, on a host that has them.

Why: most users' x86 CPUs have AVX-512 and no AMX, so a speed measured with AMX is not the speed they get.
Switched off, it reaches both places that use the tiles: our CPU ops are compiled without them (the flags
join the build's cache key, so the two builds sit side by side), and oneDNN, which torch's bf16 matmuls and
the packed projections run on, is capped at AVX-512 BF16 (its ONEDNN_MAX_CPU_ISA). MKL, which torch's fp32
matmuls run on, is capped at plain AVX-512 (MKL_ENABLE_INSTRUCTIONS=AVX512: no AMX for certain, and no VNNI or
BF16 paths either, which its fp32 products do not use).
"""

from __future__ import annotations

import os

NO_AMX_ENV = "TIDEFLOW_NO_AMX"
NO_AMX_CFLAGS = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
# What oneDNN and MKL read, once, when they first pick their kernels: set before torch computes anything.
LIBRARY_CAPS = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512"}


def amx_off() -> bool:
    value = os.environ.get(NO_AMX_ENV, "").strip().lower()
    if value not in ("", "0", "1", "true", "false", "yes", "no"):
        raise ValueError(f"${NO_AMX_ENV}={value!r}: set it to 1 (compute without AMX) or 0")
    return value in ("1", "true", "yes")


def cflags(arch: str) -> list[str]:
    """Compiler flags that keep AMX out of a CPU build for `arch` (a portable build never has it)."""
    return list(NO_AMX_CFLAGS) if amx_off() and arch != "cpu" else []


def cap_libraries() -> None:
    """Cap oneDNN and MKL below AMX when AMX is switched off (an explicit cap of the user's wins). Called at a
    process's start, before its first matmul: both libraries read the cap once."""
    if amx_off():
        for name, value in LIBRARY_CAPS.items():
            os.environ.setdefault(name, value)
