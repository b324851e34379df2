"""What configures PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp) as far
as the reserved bytes go: c10's size constants, `AllocatorSettings` parsed from
PYTORCH_CUDA_ALLOC_CONF (or a snapshot's `allocator_settings`), c10's block rounding
(`AllocatorSettings.round_size`) and the segment a block gets (`allocation_size`). The model
that applies them is train/memory/allocator.py."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

KiB, MiB = 1 << 10, 1 << 20

# Constants of CUDACachingAllocator.cpp: every block is rounded up to kMinBlockSize; blocks up
# to kSmallSize come from kSmallBuffer segments of the small pool; larger ones from kLargeBuffer
# segments when under kMinLargeAlloc, else from a segment of their own rounded to kRoundLarge
# (get_allocation_size). Expandable segments map pages of kSmallBuffer / kLargeBuffer.
MIN_BLOCK_BYTES = 512
SMALL_SIZE_BYTES = 1 * MiB
SMALL_BUFFER_BYTES = 2 * MiB
LARGE_BUFFER_BYTES = 20 * MiB
MIN_LARGE_ALLOC_BYTES = 10 * MiB
ROUND_LARGE_BYTES = 2 * MiB
# Every segment and every mapped page is a multiple of this, so the reserved bytes, the
# amounts c10 compares with a limit and hence the smallest limit are too.
LIMIT_RESOLUTION_BYTES = 2 * MiB
# roundup_power2_divisions has one entry per power-of-two interval from 1 MiB
# (kRoundUpPowerOfTwoIntervals = 16 in c10/core/AllocatorConfig.cpp).
_POWER2_INTERVALS = 16

_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_IGNORED_KEYS = {  # known to torch 2.14, no effect on the reserved bytes of one stream
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
    "expandable_segments_handle_type",
}


def round_up(n: int, unit: int) -> int:
    """`n` rounded up to a multiple of `unit`."""
    return -(-n // unit) * unit


@dataclass(frozen=True)
class AllocatorSettings:
    """What PYTORCH_CUDA_ALLOC_CONF configures that changes the reserved bytes.

    `backend="cudaMallocAsync"` hands allocation to CUDA's stream-ordered pool; the caching
    allocator model does not apply to it (see train/memory/reserve.py `predict_reserved`)."""

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None  # None: c10's SIZE_MAX, every block splits
    max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES
    roundup_power2_divisions: tuple[int, ...] = (0,) * _POWER2_INTERVALS
    garbage_collection_threshold: float = 0.0  # acts only under a per-process limit
    backend: str = "native"

    def __post_init__(self):
        problems = []
        if self.backend not in ("native", "cudaMallocAsync"):
            problems.append(f"backend must be native or cudaMallocAsync, got {self.backend!r}")
        if self.max_split_size_bytes is not None and self.max_split_size_bytes < LARGE_BUFFER_BYTES:
            problems.append("max_split_size_bytes must be >= 20 MiB")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            problems.append("garbage_collection_threshold must be in [0, 1)")
        if len(self.roundup_power2_divisions) != _POWER2_INTERVALS or any(
            d and d & (d - 1) for d in self.roundup_power2_divisions
        ):
            problems.append("roundup_power2_divisions must be 16 powers of 2 (or 0)")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> AllocatorSettings:
        """The settings torch 2.14 reads: PYTORCH_CUDA_ALLOC_CONF if set (even empty), else
        PYTORCH_ALLOC_CONF, never both (CUDAAllocatorConfig::instance and
        AcceleratorAllocatorConfig::instance try the names in that order and parse the first
        one set; the installed torch/include/c10/cuda/CUDAAllocatorConfig.h shows the order)."""
        for variable in _CONF_VARIABLES:
            if variable in environ:
                return cls.from_conf(environ[variable], variable)
        return cls()

    @classmethod
    def from_conf(cls, conf: str, variable: str = "PYTORCH_CUDA_ALLOC_CONF") -> AllocatorSettings:
        """Parses `key:value,key:[a:b,>:c]` as c10's ConfigTokenizer and parseArgs do."""
        values = {}
        for key, value in _conf_items(conf, variable):
            try:
                values.update(_parse_conf_value(key, value))
            except ValueError as error:
                raise ValueError(
                    f"{variable}={conf!r}: {error}; fix or unset {variable} (torch refuses it too)"
                ) from None
        return cls(**values)

    @classmethod
    def from_snapshot(cls, snapshot: Mapping) -> AllocatorSettings:
        """The `allocator_settings` of a `torch.cuda.memory._snapshot()` dump; older torch
        writes none (defaults)."""
        settings = snapshot.get("allocator_settings")
        if not settings:
            return cls()
        max_split = settings.get("max_split_size", -1)
        divisions = settings.get("roundup_power2_divisions") or {}
        return cls(
            expandable_segments=bool(settings.get("expandable_segments", False)),
            max_split_size_bytes=None if max_split in (-1, None) else int(max_split),
            roundup_power2_divisions=tuple(int(divisions.get(str(1 << i), 0)) for i in range(16)),
            garbage_collection_threshold=float(settings.get("garbage_collection_threshold", 0.0)),
            backend="native",  # a snapshot exists only for the native allocator
        )

    def round_size(self, nbytes: int) -> int:
        """c10's round_size: 512 B multiples, or the next power-of-2 division."""
        if nbytes < MIN_BLOCK_BYTES:
            return MIN_BLOCK_BYTES
        divisions = self.roundup_power2_divisions[_power2_interval(nbytes)]
        if divisions > 1 and nbytes > MIN_BLOCK_BYTES * divisions:
            return _next_power2_division(nbytes, divisions)
        return round_up(nbytes, MIN_BLOCK_BYTES)


def _conf_items(conf: str, variable: str) -> Iterable[tuple[str, str]]:
    for item in re.findall(r"[^,\[\]]+(?:\[[^\]]*\])?", conf):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition(":")
        if not sep:
            raise ValueError(
                f"{variable}={conf!r}: {item!r} is not key:value; "
                f"write e.g. {variable}=expandable_segments:True"
            )
        yield key.strip(), value.strip()


def _parse_conf_value(key: str, value: str) -> dict:
    if key == "expandable_segments":
        if value not in ("True", "False"):
            raise ValueError(f"expandable_segments must be True or False, got {value!r}")
        return {"expandable_segments": value == "True"}
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        mb = int(value)
        if mb < LARGE_BUFFER_BYTES // MiB:
            raise ValueError(f"{key} must be >= 20, got {mb}")
        return {key.removesuffix("_mb") + "_bytes": mb * MiB}
    if key == "garbage_collection_threshold":
        threshold = float(value)
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"garbage_collection_threshold must be in (0.0, 1.0), got {value}")
        return {"garbage_collection_threshold": threshold}
    if key == "roundup_power2_divisions":
        return {"roundup_power2_divisions": _parse_divisions(value)}
    if key == "backend":
        if value not in ("native", "cudaMallocAsync"):
            raise ValueError(f"backend must be native or cudaMallocAsync, got {value!r}")
        return {"backend": value}
    if key in _IGNORED_KEYS:
        return {}
    raise ValueError(f"unrecognized key {key!r}")


def _parse_divisions(value: str) -> tuple[int, ...]:
    """parseRoundUpPower2Divisions: one number for all intervals, or `[256:1,512:2,>:4]` where
    a boundary in MiB sets its interval (and every one below, for the first), `>` the rest."""
    if not value.startswith("["):
        divisions = int(value)
        _check_power2(divisions, "the divisions")
        return (divisions,) * _POWER2_INTERVALS
    table = [0] * _POWER2_INTERVALS
    first, last_index = True, 0
    for pair in value.strip("[]").split(","):
        boundary, _, divisions_text = pair.partition(":")
        divisions = int(divisions_text)
        if divisions:
            _check_power2(divisions, "the divisions")
        if boundary.strip() == ">":
            table[last_index + 1 :] = [divisions] * (_POWER2_INTERVALS - last_index - 1)
            continue
        boundary_mb = int(boundary)
        _check_power2(boundary_mb, "the intervals")
        index = min(boundary_mb.bit_length() - 1, _POWER2_INTERVALS - 1)
        if first:
            table[:index] = [divisions] * index
            first = False
        table[index], last_index = divisions, index
    return tuple(table)


def _check_power2(n: int, what: str) -> None:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"for roundups, {what} have to be a power of 2, got {n}")


def _power2_interval(nbytes: int) -> int:
    """AcceleratorAllocatorConfig::roundup_power2_divisions's index: log2 above 1 MiB."""
    return min(max(nbytes.bit_length() - 1 - 20, 0), _POWER2_INTERVALS - 1)


def _next_power2_division(nbytes: int, divisions: int) -> int:
    """roundup_power2_next_division: 1200 with 4 divisions of [1024, 2048) -> 1280."""
    if nbytes & (nbytes - 1) == 0:
        return nbytes
    floor = 1 << (nbytes.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    return round_up(nbytes, step)


def allocation_size(nbytes: int) -> int:
    """c10's get_allocation_size: the segment a rounded block of `nbytes` gets."""
    if nbytes <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if nbytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return round_up(nbytes, ROUND_LARGE_BYTES)


# ------------------------------------------------------------------------------ the model
