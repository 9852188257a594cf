"""The model's CPU weights moved into one anonymous memory arena, advised for transparent huge pages.

A CPU decode step streams every weight it uses from memory once (fp32 experts alone are 50 MB a layer of
the default model), so how that memory is mapped shows in every step:
- Loaded as they come, the weights are pages of the safetensors file mapping (tensors the load did not
  convert) or heap blocks among small allocations (the stacked experts). File pages can also be dropped
  under memory pressure and read back from disk in the middle of a request.
- With 4 KB pages, each 4 KB of a weight stream is a TLB miss: the second-level TLB covers a few MB, far
  less than a layer's weights, so every page costs a page walk.
One private anonymous arena, aligned to and advised for 2 MB pages (MADV_HUGEPAGE, which the kernel's
"madvise" THP mode, the common default, honours), fixes both. Measured on the default fp32 model, one
process, 2 cores, batch-32 decode step: 35.9 ms as loaded, 33.9 ms in one arena of 4 KB pages, 32.6 ms in
the arena in huge pages; the routed experts alone (32 tokens, top-2 of 8): 2.54 -> 2.19 ms a layer. bf16
steps were unchanged (their experts stream half the bytes, through AMX tiles).

Where THP is off ("never") or the platform has no MADV_HUGEPAGE, the weights still move into the arena,
in small pages. The weights are copied one tensor at a time and the loaded tensor is released after each,
so memory peaks at the weights plus the largest tensor, not twice the weights.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor starts on a cache line, as the kernels' vector loads prefer


@dataclass(frozen=True)
class Arena:
    """Where the weights went: the arena's first address and size, and how much of it the kernel backs with
    huge pages (from /proc/self/smaps; 0 where that file is missing)."""

    start: int
    size: int
    huge_bytes: int


def move_weights(model: nn.Module) -> Arena | None:
    """Move every CPU parameter of `model` (tied ones once) into one arena; None when it has none."""
    # id(parameter) -> its offset in the arena. Ids, not the parameters: holding them here would keep every
    # loaded tensor alive until the end. An id stays unique while its parameter lives, and a parameter is
    # looked up only while a module not yet moved holds it.
    offsets: dict[int, int] = {}
    size = 0
    for param in model.parameters():  # each parameter once, tied or not
        if param.device.type == "cpu" and id(param) not in offsets:
            offsets[id(param)] = size
            size += -(-param.numel() * param.element_size() // ALIGN) * ALIGN
    if not offsets or not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    try:
        memory = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # e.g. a strict overcommit limit: the weights stay where the load put them
        log.warning("weights stay as loaded: no arena of %.0f MB could be mapped (%s)", size / 1e6, exc)
        return None
    lead = -ctypes.addressof(ctypes.c_char.from_buffer(memory)) % HUGE_PAGE  # to the first 2 MB boundary
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE, lead, size)  # before any page is touched, so faults take huge pages
    arena = torch.frombuffer(memory, dtype=torch.uint8, count=size, offset=lead)  # holds the mapping alive
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or id(param) not in offsets:
                continue
            if id(param) not in moved:
                offset, nbytes = offsets[id(param)], param.numel() * param.element_size()
                data = arena[offset:offset + nbytes].view(param.dtype).view(param.shape)
                data.copy_(param.detach())
                moved[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            module._parameters[name] = moved[id(param)]
    start = arena.data_ptr()
    return Arena(start=start, size=size, huge_bytes=huge_page_bytes(start))


def mapping_fields(address: int, smaps: Path = Path("/proc/self/smaps")) -> dict[str, str]:
    """The /proc/self/smaps fields (AnonHugePages, VmFlags, ...) of the mapping holding `address`; empty
    where that file is missing (not Linux) or no mapping holds it."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    inside = False
    for line in lines:
        head, _, rest = line.partition(" ")
        if not head.endswith(":"):  # a mapping's first line: "low-high perms offset dev inode [path]"
            if inside:
                break
            low, high = (int(bound, 16) for bound in head.split("-"))
            inside = low <= address < high
        elif inside:
            fields[head[:-1]] = rest.strip()
    return fields


def huge_page_bytes(address: int) -> int:
    """Bytes of the mapping holding `address` that the kernel backs with huge pages (0 where unknown)."""
    value = mapping_fields(address).get("AnonHugePages", "0 kB").split()[0]
    return int(value) * 1024
