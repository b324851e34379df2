"""Byte sizes as people write them: a memory budget parsed (bytes, `8GiB`, `512MiB`, or `90%` of
the device), a device's total memory, and bytes formatted for reading.
"""

from __future__ import annotations

import math
import os
import re

import torch

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
MAX_BUDGET_BYTES = 2**50  # 1 PiB: no device has more; a larger budget is a typo
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_budget(value: int | float | str | None, total_bytes: int) -> int | None:
    """Bytes of a budget given as bytes, a size string (`8GiB`, `512MiB`) or a share (`90%`).

    None means no budget beyond the device itself. Raises ValueError with the accepted forms.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a memory size")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 1:
            raise ValueError(f"{value!r} is not a positive number of bytes (finite, at least 1)")
        return int(value)
    percent = _PERCENT.match(value)
    if percent:
        share = float(percent.group(1))
        if not 0 < share <= 100 or total_bytes * share / 100 < 1:
            raise ValueError(f"{value!r} is not a share between 0% and 100%")
        return int(total_bytes * share / 100)
    size = _SIZE.match(value)
    if size and size.group(2).lower() in _UNITS:
        num_bytes = float(size.group(1)) * _UNITS[size.group(2).lower()]
        if num_bytes >= 1:
            return int(num_bytes)
    raise ValueError(
        f"{value!r} is not a memory size; use bytes (8589934592), a size with a unit "
        "(8GiB, 512MiB, 16GB) or a share of the device (90%)"
    )


def device_total_bytes(device: torch.device) -> int:
    """Memory of the device: the GPU's for CUDA, the host's physical memory for CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def format_bytes(num_bytes: float | None) -> str:
    if num_bytes is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(num_bytes) < 1024 or unit == "PiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")
