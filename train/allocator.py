"""A model of PyTorch's CUDA caching allocator, as far as it decides how much memory is
reserved: the peak a CUDA run's prediction is compared against the budget with (the live
tensor bytes of a step, replayed through it)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# --- The CUDA caching allocator, as far as it decides how much memory is reserved ----------
# Constants of c10/cuda/CUDACachingAllocator.cpp: every block is rounded up to 512 bytes;
# blocks up to 1 MiB come from 2 MiB segments of the small pool; larger ones from 20 MiB
# segments when under 10 MiB, else from a segment of their own rounded up to 2 MiB. A free
# block is reused best-fit and split when the rest is worth keeping; segments are kept. With
# expandable segments the large pool is one segment mapped in 20 MiB pages.
_MIN_BLOCK = 512
_SMALL_SIZE = 1 << 20
_SMALL_BUFFER = 2 << 20
_LARGE_BUFFER = 20 << 20
_MIN_LARGE_ALLOC = 10 << 20
_ROUND_LARGE = 2 << 20


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True


class CachingAllocatorModel:
    """Reserved bytes of PyTorch's CUDA caching allocator for a sequence of allocations and
    frees (one stream, no `empty_cache`). With expandable segments (PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True) the large pool is one segment that grows in pages of
    kLargeBuffer (20 MiB), and any rest of a block is split off."""

    def __init__(self, expandable: bool = False):
        self.expandable = expandable
        self.segments: list[list[_Block]] = []  # blocks of each segment, by offset
        self.small: set[int] = set()  # segments of the small pool
        self.live: dict[int, _Block] = {}
        self.reserved_bytes = 0
        self.peak_reserved_bytes = 0

    def malloc(self, key: int, nbytes: int) -> None:
        size = max(_MIN_BLOCK, _round_up(nbytes, _MIN_BLOCK))
        small = size <= _SMALL_SIZE
        block = self._best_fit(size, small) or self._new_segment(size, small)
        rest = block.size - size
        if rest >= _MIN_BLOCK if small or self.expandable else rest > _SMALL_SIZE:
            blocks = self.segments[block.segment]
            tail = _Block(block.segment, block.offset + size, rest)
            blocks.insert(blocks.index(block) + 1, tail)
            block.size = size
        block.free = False
        self.live[key] = block

    def free(self, key: int) -> None:
        block = self.live.pop(key)
        block.free = True
        blocks = self.segments[block.segment]
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free:  # merge with the next free block
            block.size += blocks.pop(i + 1).size
        if i > 0 and blocks[i - 1].free:  # and with the previous one
            blocks[i - 1].size += blocks.pop(i).size

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        candidates = [
            b
            for s, blocks in enumerate(self.segments)
            if (s in self.small) == small
            for b in blocks
            if b.free and b.size >= size
        ]
        return min(candidates, key=lambda b: (b.size, b.segment, b.offset), default=None)

    def _new_segment(self, size: int, small: bool) -> _Block:
        if self.expandable and not small and self._large_segment() is not None:
            return self._grow(size)
        if small:
            segment_bytes = _SMALL_BUFFER
        elif self.expandable:
            segment_bytes = _round_up(size, _LARGE_BUFFER)
        elif size < _MIN_LARGE_ALLOC:
            segment_bytes = _LARGE_BUFFER
        else:
            segment_bytes = _round_up(size, _ROUND_LARGE)
        index = len(self.segments)
        self.segments.append([_Block(index, 0, segment_bytes)])
        if small:
            self.small.add(index)
        self._reserve(segment_bytes)
        return self.segments[index][0]

    def _large_segment(self) -> int | None:
        return next((s for s in range(len(self.segments)) if s not in self.small), None)

    def _grow(self, size: int) -> _Block:
        """Expandable segment: map pages at the end, merging with a free block there."""
        index = self._large_segment()
        blocks = self.segments[index]
        last = blocks[-1]
        if not last.free:
            last = _Block(index, last.offset + last.size, 0)
            blocks.append(last)
        grow = _round_up(size - last.size, _LARGE_BUFFER)
        last.size += grow
        self._reserve(grow)
        return last

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)


def cublas_workspace_bytes(device: torch.device) -> int:
    """The workspace cuBLAS keeps per handle and stream, from the caching allocator: the
    CUBLAS_WORKSPACE_CONFIG sizes if set, else PyTorch's defaults (32 MiB on Hopper and later,
    4096 KiB x 2 + 16 KiB x 8 before)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        parts = [int(p) for p in config.strip(":").split(":") if p.isdigit()]
        return (
            sum(size * count for size, count in zip(parts[::2], parts[1::2], strict=False)) * 1024
        )
    major = torch.cuda.get_device_capability(device)[0] if torch.cuda.is_available() else 8
    return 32 * 2**20 if major >= 9 else (4096 * 2 + 16 * 8) * 1024


def expandable_segments() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def cuda_reserved_bytes(events: list[tuple[int, int]], device: torch.device) -> int:
    """Peak reserved bytes for a tracked step's allocations: the allocator model, with the
    cuBLAS workspace allocated first (it lives from the first matmul on)."""
    allocator = CachingAllocatorModel(expandable=expandable_segments())
    allocator.malloc(-1, cublas_workspace_bytes(device))
    for key, nbytes in events:
        if nbytes < 0:
            allocator.free(key)
        else:
            allocator.malloc(key, nbytes)
    return allocator.peak_reserved_bytes
