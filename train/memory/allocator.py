"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), as far as it
decides how much memory a step *reserves*: the figure a CUDA prediction is compared with the
budget by. It replays a step's allocations and frees (`(key, nbytes)` and `(key, -1)`) through
c10's rules: block rounding, best fit by (size, address), splitting, merging, new segments,
expandable segments, max_split_size, garbage collection and, under a per-process limit, c10's
release-and-retry before an out-of-memory error. `predict_reserved` is what the predictor
calls; `bench/cuda_trace.py` checks the model event by event against real CUDA traces.

Blocks serve only the CUDA stream that allocated their segment, as in c10; `empty_cache` is
`release_cached_blocks`, and a trace's segment_free / segment_unmap are `release_segment` /
`unmap`. No CUDA graphs (private pools) and no record_stream (a free is final)."""

from __future__ import annotations

import bisect
import itertools
import operator
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

KiB, MiB = 1 << 10, 1 << 20

# Constants of CUDACachingAllocator.cpp: every block is rounded up to kMinBlockSize; blocks up
# to kSmallSize come from kSmallBuffer segments of the small pool; larger ones from kLargeBuffer
# segments when under kMinLargeAlloc, else from a segment of their own rounded to kRoundLarge
# (get_allocation_size). Expandable segments map pages of kSmallBuffer / kLargeBuffer.
_MIN_BLOCK = 512
_SMALL_SIZE = 1 * MiB
_SMALL_BUFFER = 2 * MiB
_LARGE_BUFFER = 20 * MiB
_MIN_LARGE_ALLOC = 10 * MiB
_ROUND_LARGE = 2 * MiB
# Every segment and every mapped page is a multiple of this, so the reserved bytes, the
# amounts c10 compares with a limit and hence the smallest limit are too.
LIMIT_RESOLUTION_BYTES = 2 * MiB
# roundup_power2_divisions has one entry per power-of-two interval from 1 MiB
# (kRoundUpPowerOfTwoIntervals = 16 in c10/core/AllocatorConfig.cpp).
_POWER2_INTERVALS = 16
# Address space of an expandable segment when the device's size is not given: c10 reserves
# 9/8 of the device (find_expandable_block); it only has to exceed any hole unmapping leaves.
_EXPANDABLE_VA_BYTES = 1 << 40
_SYNTHETIC_BASE = 1 << 48  # new segments without a caller's address go above any real one
# Under a limit alloc_block checks get_allocation_size (a large request rounded to 2 MiB) but
# an expandable segment maps whole 20 MiB pages: it may end up to 18 MiB over the limit.
_EXPANDABLE_LIMIT_SLACK = _LARGE_BUFFER - _ROUND_LARGE

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


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


# ------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class AllocatorSettings:
    """What PYTORCH_CUDA_ALLOC_CONF configures that changes the reserved bytes.

    `backend="cudaMallocAsync"` hands allocation to CUDA's stream-ordered pool; the caching
    allocator model does not apply to it (see `predict_reserved`)."""

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None  # None: c10's SIZE_MAX, every block splits
    max_non_split_rounding_bytes: int = _LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * _POWER2_INTERVALS
    garbage_collection_threshold: float = 0.0  # acts only under a per-process limit
    backend: str = "native"

    def __post_init__(self):
        problems = []
        if self.backend not in ("native", "cudaMallocAsync"):
            problems.append(f"backend must be native or cudaMallocAsync, got {self.backend!r}")
        if self.max_split_size_bytes is not None and self.max_split_size_bytes < _LARGE_BUFFER:
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
        if nbytes < _MIN_BLOCK:
            return _MIN_BLOCK
        divisions = self.roundup_power2_divisions[_power2_interval(nbytes)]
        if divisions > 1 and nbytes > _MIN_BLOCK * divisions:
            return _next_power2_division(nbytes, divisions)
        return _round_up(nbytes, _MIN_BLOCK)


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
        if mb < _LARGE_BUFFER // MiB:
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
    return _round_up(nbytes, step)


def allocation_size(nbytes: int) -> int:
    """c10's get_allocation_size: the segment a rounded block of `nbytes` gets."""
    if nbytes <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if nbytes < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return _round_up(nbytes, _ROUND_LARGE)


# ------------------------------------------------------------------------------ the model


class AllocatorOutOfMemory(Exception):
    """c10 raised torch.OutOfMemoryError: no cached block fitted and a new segment would pass
    the limit even after releasing every cached one."""

    def __init__(self, requested_bytes: int, reserved_bytes: int, limit_bytes: int | None):
        self.requested_bytes = requested_bytes
        self.reserved_bytes = reserved_bytes
        self.limit_bytes = limit_bytes
        super().__init__(
            f"allocating {requested_bytes} bytes with {reserved_bytes} reserved would pass the "
            f"limit of {limit_bytes} bytes after releasing every cached segment"
        )


@dataclass(frozen=True)
class SegmentState:
    """A segment of an existing allocator state (for an expandable one: a mapped range, as a
    snapshot reports it)."""

    address: int
    size_bytes: int
    small: bool
    expandable: bool = False
    stream: int = 0  # the CUDA stream that allocated it


@dataclass(eq=False, slots=True)
class _Segment:
    address: int
    size_bytes: int  # the address space of an expandable segment
    small: bool
    expandable: bool
    stream: int  # the stream that allocated it: its blocks serve that stream only
    # Its pool's sorted keys of the stream's free and unmapped blocks (_Pool.keys[stream],
    # _Pool.unmapped[stream]), held here so that caching a block looks up no stream.
    free_keys: list[tuple[int, int]] = field(default_factory=list, repr=False)
    unmapped_keys: list[int] = field(default_factory=list, repr=False)

    @property
    def page_bytes(self) -> int:
        return _SMALL_BUFFER if self.small else _LARGE_BUFFER

    @property
    def end(self) -> int:
        return self.address + self.size_bytes


@dataclass(eq=False, slots=True)
class _Block:
    address: int
    size: int
    segment: _Segment
    prev: _Block | None = None
    next: _Block | None = None
    allocated: bool = False
    mapped: bool = True
    gc_base: int = 0  # the pool's get_free_block count when it was cached (c10 gc_count_base)


def _expandable_size(block: _Block) -> int:
    """get_free_block's expandable_size: a free block followed by unmapped space can grow."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


@dataclass(eq=False)
class _Pool:
    """A BlockPool: free mapped blocks by stream, then (size, address) (BlockComparatorSize),
    unmapped ones by stream, then address (BlockComparatorAddress): a sorted list per stream.
    `blocks` and `unmapped_blocks` map an address to its block: no two segments the model
    holds overlap (CachingAllocatorModel._place), so no two blocks share one."""

    small: bool
    keys: defaultdict[int, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    blocks: dict[int, _Block] = field(default_factory=dict)
    unmapped: defaultdict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    unmapped_blocks: dict[int, _Block] = field(default_factory=dict)
    get_free_calls: int = 0

    def join(self, segment: _Segment) -> None:
        """A new segment of the pool shares its stream's sorted keys."""
        segment.free_keys = self.keys[segment.stream]
        segment.unmapped_keys = self.unmapped[segment.stream]

    def insert(self, block: _Block) -> None:
        if block.mapped:
            block.gc_base = self.get_free_calls
            bisect.insort(block.segment.free_keys, (block.size, block.address))
            self.blocks[block.address] = block
        else:
            bisect.insort(block.segment.unmapped_keys, block.address)
            self.unmapped_blocks[block.address] = block

    def remove(self, block: _Block) -> None:
        if block.mapped:
            keys = block.segment.free_keys
            del keys[bisect.bisect_left(keys, (block.size, block.address))]
            del self.blocks[block.address]
        else:
            unmapped = block.segment.unmapped_keys
            del unmapped[bisect.bisect_left(unmapped, block.address)]
            del self.unmapped_blocks[block.address]

    def free_blocks(self) -> list[_Block]:
        """The free mapped blocks in c10's order: by stream, size, address."""
        return [self.blocks[a] for stream in sorted(self.keys) for _, a in self.keys[stream]]


class CachingAllocatorModel:
    """Reserved bytes and segments of c10's caching allocator for a sequence of `malloc` and
    `free`. `limit_bytes` is a per-process limit (torch.cuda.set_per_process_memory_fraction
    times the device): c10's alloc_block refuses a segment that would pass it.
    `device_bytes` is the device's memory: cudaMalloc or cuMemCreate fail past it (with
    expandable segments only the pages mapped count, not the whole segment)."""

    def __init__(
        self,
        settings: AllocatorSettings | None = None,
        limit_bytes: int | None = None,
        device_bytes: int | None = None,
    ):
        self.settings = settings or AllocatorSettings()
        self.limit_bytes = limit_bytes
        self.device_bytes = device_bytes
        self.pools = {True: _Pool(small=True), False: _Pool(small=False)}
        self.live: dict[object, _Block] = {}
        self.reserved_bytes = 0
        self.peak_reserved_bytes = 0
        self.num_segments = 0  # as a snapshot counts: an expandable one per mapped range
        self._segments: dict[int, _Segment] = {}  # by address; never two over one byte
        self._segment_starts: list[int] = []  # their addresses, sorted
        self._seed_reserved_bytes = 0  # a seeded state may be over the limit
        self._next_synthetic_address = _SYNTHETIC_BASE
        self._gc = limit_bytes is not None and self.settings.garbage_collection_threshold > 0
        # _Runs: while a list, each alloc_block's limit check as (event, reserved + segment)
        self._checks: list[tuple[int, int]] | None = None
        self._at = 0  # the event being replayed, for _checks

    @property
    def expandable_va_bytes(self) -> int:
        if self.device_bytes is None:
            return _EXPANDABLE_VA_BYTES
        return _round_up(self.device_bytes + self.device_bytes // 8, _LARGE_BUFFER)

    # --- the public operations -------------------------------------------------------

    def malloc(
        self, key: object, nbytes: int, segment_address: int | None = None, stream: int = 0
    ) -> int:
        """c10's malloc on `stream` (a free block serves the stream its segment was allocated
        on only); returns the block's address. `segment_address` is where a new segment goes
        if one is needed (a trace's segment_alloc), else a synthetic one; also a synthetic
        one when the model holds a segment over that range (see _place)."""
        return self._malloc_block(key, self.settings.round_size(nbytes), segment_address, stream)

    def _malloc_block(
        self, key: object, size: int, segment_address: int | None = None, stream: int = 0
    ) -> int:
        """malloc of a size round_size gave (a replay rounds each size once, not per run)."""
        pool = self.pools[size <= _SMALL_SIZE]
        block = self._get_free_block(pool, size, stream)
        if block is None:
            block = self._alloc_with_retry(pool, size, stream, segment_address)
        self._alloc_found_block(pool, block, size)
        self.live[key] = block
        return block.address

    def free(self, key: object) -> None:
        """c10's free_block: merge with free neighbours and cache the block."""
        block = self.live.pop(key)
        block.allocated = False
        pool = self.pools[block.segment.small]
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert(block)

    def release_cached_blocks(self) -> None:
        """c10's release_cached_blocks (empty_cache): free every wholly free segment; with
        expandable segments unmap every whole free page (release_blocks, unmap_block)."""
        for small in (False, True):
            pool = self.pools[small]
            for block in pool.free_blocks():
                if block.segment.expandable:
                    self._unmap_block(pool, block)
                elif block.prev is None and block.next is None:
                    self._release_block(pool, block)

    def release_segment(self, address: int) -> bool:
        """Frees the segment at `address` (cudaFree) if the model holds it wholly free, as the
        real allocator did where a trace shows segment_free (empty_cache in user code, c10's
        release-and-retry or garbage collection); says whether it did. The model keeps a
        segment it holds blocks of, or none at that address: it placed them differently."""
        segment = self._segments.get(address)
        if segment is None or segment.expandable:
            return False
        pool = self.pools[segment.small]
        block = pool.blocks.get(address)
        if block is None or block.next is not None:
            return False
        self._release_block(pool, block)
        return True

    def unmap(self, address: int, nbytes: int) -> bool:
        """Unmaps the pages [address, address + nbytes) of an expandable segment if the model
        holds them mapped and free, as the real allocator did where a trace shows
        segment_unmap; says whether it did."""
        segment = self._overlapping(address, 1)
        if segment is None or not segment.expandable or nbytes <= 0:
            return False
        if (address - segment.address) % segment.page_bytes or nbytes % segment.page_bytes:
            return False
        pool, end = self.pools[segment.small], address + nbytes
        for block in pool.blocks.values():  # free neighbours merge: one block holds them all
            if block.address <= address and end <= block.address + block.size:
                self._unmap_pages(pool, block, address, end)
                return True
        return False

    def segment_blocks(self) -> list[list[tuple[int, int, bool]]]:
        """`(address, size, allocated)` of every mapped block, per segment, by address."""
        blocks = list(self.live.values())
        for pool in self.pools.values():
            blocks += pool.blocks.values()
        by_segment: dict[int, list[_Block]] = {}
        for block in blocks:
            by_segment.setdefault(id(block.segment), []).append(block)
        return sorted(
            sorted((b.address, b.size, b.allocated) for b in segment)
            for segment in by_segment.values()
        )

    def copy(self) -> CachingAllocatorModel:
        """An independent copy of the state: its segments, blocks (linked as here), free
        block indexes and live allocations; the settings and limits are the same."""
        new = CachingAllocatorModel.__new__(CachingAllocatorModel)
        new.__dict__.update(self.__dict__)
        segments = {
            address: _Segment(s.address, s.size_bytes, s.small, s.expandable, s.stream)
            for address, s in self._segments.items()
        }
        new._segments, new._segment_starts = segments, list(self._segment_starts)
        new.pools = {}
        for small, pool in self.pools.items():
            copied = new.pools[small] = _Pool(small=small, get_free_calls=pool.get_free_calls)
            for stream, keys in pool.keys.items():
                copied.keys[stream] = list(keys)
            for stream, unmapped in pool.unmapped.items():
                copied.unmapped[stream] = list(unmapped)
        for segment in segments.values():
            new.pools[segment.small].join(segment)
        blocks: dict[int, _Block] = {}  # id of a block here -> its copy
        for block in itertools.chain(
            self.live.values(),
            *(pool.blocks.values() for pool in self.pools.values()),
            *(pool.unmapped_blocks.values() for pool in self.pools.values()),
        ):
            blocks[id(block)] = _Block(
                block.address,
                block.size,
                segments[block.segment.address],
                block.prev,
                block.next,
                block.allocated,
                block.mapped,
                block.gc_base,
            )
        for block in blocks.values():
            if block.prev is not None:
                block.prev = blocks[id(block.prev)]
            if block.next is not None:
                block.next = blocks[id(block.next)]
        new.live = {key: blocks[id(block)] for key, block in self.live.items()}
        for small, pool in self.pools.items():
            copied = new.pools[small]
            copied.blocks = {a: blocks[id(b)] for a, b in pool.blocks.items()}
            copied.unmapped_blocks = {a: blocks[id(b)] for a, b in pool.unmapped_blocks.items()}
        return new

    def check(self) -> None:
        """Raises AssertionError naming the first broken invariant, read from the blocks
        themselves: every segment, walked by its links, is tiled by its blocks; each free
        block is in its pool's index once and the index holds nothing else; no two free
        neighbours of one mapped state (they merge); the live keys name the allocated
        blocks; no two segments overlap; the reserved bytes, segment count and peak agree
        with the blocks; the limit and the device's memory hold. For tests and debugging:
        O(blocks), and malloc and free never call it."""
        assert self._segment_starts == sorted(self._segments), (
            "the sorted segment addresses and the segment map disagree"
        )
        live_at = {b.address: b for b in self.live.values()}
        totals, previous = _Totals(), None
        for address in self._segment_starts:
            segment = self._segments[address]
            assert previous is None or previous.end <= address, (
                f"the segments at {previous.address:#x} ({previous.size_bytes} bytes) and "
                f"{address:#x} overlap"
            )
            pool = self.pools[segment.small]
            assert (
                segment.free_keys is pool.keys[segment.stream]
                and segment.unmapped_keys is pool.unmapped[segment.stream]
            ), f"the segment at {address:#x} holds another index than its stream's"
            head = live_at.get(address) or pool.blocks.get(address)
            totals.add(segment, _segment_blocks(segment, head or pool.unmapped_blocks.get(address)))
            previous = segment
        _check_blocks(self, totals)
        for pool in self.pools.values():
            _check_index(pool)
        self._check_totals(totals)

    def _check_totals(self, totals: _Totals) -> None:
        figures = (self.reserved_bytes, self.num_segments)
        walked = (totals.reserved_bytes, totals.num_segments)
        assert figures == walked, (
            f"reserved bytes and segments are {figures}, the blocks give {walked}"
        )
        assert self.peak_reserved_bytes >= self.reserved_bytes, "peak below reserved"
        seeded = self._seed_reserved_bytes
        if self.limit_bytes is not None:
            slack = _EXPANDABLE_LIMIT_SLACK if self.settings.expandable_segments else 0
            assert self.reserved_bytes <= max(self.limit_bytes + slack, seeded), (
                f"{self.reserved_bytes} bytes reserved under a limit of {self.limit_bytes}"
            )
        if self.device_bytes is not None:
            assert self.reserved_bytes <= max(self.device_bytes, seeded), (
                f"{self.reserved_bytes} bytes reserved on a device of {self.device_bytes}"
            )

    # --- seeding ------------------------------------------------------------------------

    def seed(self, segments: Iterable[SegmentState], live_blocks: Iterable[tuple[int, int]]):
        """Starts from an existing state: `segments` and the live `(address, size)` blocks in
        them (keyed by address); the rest of each segment is free, merged as c10 keeps it."""
        segments, live = list(segments), sorted(live_blocks)
        expandable: dict[tuple[bool, int], list[tuple[int, int]]] = {}
        for state in segments:
            if state.expandable:  # one segment per pool and stream, as c10 grows them
                expandable.setdefault((state.small, state.stream), []).append(
                    (state.address, state.size_bytes)
                )
                continue
            segment = _Segment(state.address, state.size_bytes, state.small, False, state.stream)
            self._add_seeded(segment, [(state.address, state.size_bytes)], live)
        starts = sorted(s.address for s in segments)
        for (small, stream), ranges in sorted(expandable.items()):
            ranges.sort()
            # The address space runs to the next segment at most: c10 reserved it apart.
            start, last_end = ranges[0][0], ranges[-1][0] + ranges[-1][1]
            following = starts[bisect.bisect_right(starts, ranges[-1][0]) :]
            room = (following[0] if following else start + self.expandable_va_bytes) - start
            va_bytes = max(min(self.expandable_va_bytes, room), last_end - start)
            self._add_seeded(_Segment(start, va_bytes, small, True, stream), ranges, live)
        self._seed_reserved_bytes = self.reserved_bytes

    def _add_seeded(self, segment: _Segment, mapped: list[tuple[int, int]], live: list) -> None:
        if self._overlapping(segment.address, segment.size_bytes) is not None:
            raise ValueError(
                f"seeded segment at {segment.address:#x} of {segment.size_bytes} bytes overlaps "
                f"{self._overlapping(segment.address, segment.size_bytes)}; give disjoint segments"
            )
        self._add_segment(segment)
        self._carve(segment, mapped, live)
        self._reserve(sum(size for _, size in mapped))
        self.num_segments += len(mapped)

    def _carve(self, segment: _Segment, mapped: list[tuple[int, int]], live: list) -> None:
        """Blocks of a seeded segment: live blocks, free gaps, unmapped space between the
        mapped ranges of an expandable one."""
        pieces: list[tuple[int, int, bool, bool]] = []  # address, size, allocated, mapped
        cursor = segment.address
        for start, size in mapped:
            if start > cursor:
                pieces.append((cursor, start - cursor, False, False))
            first = bisect.bisect_left(live, (start, -1))
            last = bisect.bisect_left(live, (start + size, -1))
            cursor = start
            for address, block_size in live[first:last]:
                if address > cursor:
                    pieces.append((cursor, address - cursor, False, True))
                pieces.append((address, block_size, True, True))
                cursor = address + block_size
            if start + size > cursor:
                pieces.append((cursor, start + size - cursor, False, True))
            cursor = start + size
        end = segment.address + segment.size_bytes
        if end > cursor:
            pieces.append((cursor, end - cursor, False, False))
        self._link(segment, pieces)

    def _link(self, segment: _Segment, pieces: list[tuple[int, int, bool, bool]]) -> None:
        pool, prev = self.pools[segment.small], None
        for address, size, allocated, mapped in pieces:
            block = _Block(address, size, segment, prev=prev, allocated=allocated, mapped=mapped)
            if prev is not None:
                prev.next = block
            if allocated:
                self.live[address] = block
            else:
                pool.insert(block)
            prev = block

    # --- c10's malloc path ----------------------------------------------------------------

    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """get_free_block: the smallest cached block of the stream that fits (ties by
        address), with the expandable tail rule and max_split_size's oversize rules."""
        if self._gc:
            pool.get_free_calls += 1
        keys = pool.keys[stream]  # a defaultdict: a new stream gets an empty list
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        block = pool.blocks[keys[i][1]]
        if block.segment.expandable and self.settings.expandable_segments:
            while i + 1 < len(keys):
                nxt = pool.blocks[keys[i + 1][1]]
                if _expandable_size(nxt) >= _expandable_size(block):
                    break
                i, block = i + 1, nxt
        max_split = self.settings.max_split_size_bytes
        if max_split is not None:
            if size < max_split <= block.size:
                return None
            rounding_bytes = self.settings.max_non_split_rounding_bytes
            if size >= max_split and block.size >= size + rounding_bytes:
                return None
        pool.remove(block)
        return block

    def _alloc_with_retry(
        self, pool: _Pool, size: int, stream: int, segment_address: int | None
    ) -> _Block:
        """malloc's chain when no cached block fits: garbage collection, alloc_block, then
        release_available_cached_blocks and alloc_block, then release_cached_blocks and
        alloc_block; only then out of memory."""
        if self._gc:
            self._garbage_collect_cached_blocks()
        block = self._alloc_block(pool, size, stream, segment_address)
        if block is None and self._release_available_cached_blocks(pool, size, stream):
            block = self._alloc_block(pool, size, stream, segment_address)
        if block is None:
            self.release_cached_blocks()
            block = self._alloc_block(pool, size, stream, segment_address)
        if block is None:
            raise AllocatorOutOfMemory(size, self.reserved_bytes, self.limit_bytes)
        return block

    def _alloc_block(
        self, pool: _Pool, size: int, stream: int, segment_address: int | None
    ) -> _Block | None:
        """alloc_block: the per-process limit is checked against get_allocation_size even
        with expandable segments (which then map only the pages they lack)."""
        segment_bytes = allocation_size(size)
        if self._checks is not None:
            self._checks.append((self._at, self.reserved_bytes + segment_bytes))
        if self.limit_bytes is not None and self.reserved_bytes + segment_bytes > self.limit_bytes:
            return None
        if self.settings.expandable_segments:
            return self._try_allocate_expandable_block(pool, size, stream, segment_address)
        if (
            self.device_bytes is not None
            and self.reserved_bytes + segment_bytes > self.device_bytes
        ):
            return None  # cudaMalloc fails
        address = self._place(segment_address, segment_bytes)
        segment = _Segment(address, segment_bytes, pool.small, False, stream)
        self._add_segment(segment)
        self._reserve(segment_bytes)
        self.num_segments += 1
        return _Block(address, segment_bytes, segment)

    def _place(self, wanted: int | None, nbytes: int) -> int:
        """A new segment's address: the caller's unless the model holds a segment over any
        of that range (the real allocator released a segment there that the model keeps, or
        placed differently), else a synthetic one above every segment. Two segments over one
        address would put two free blocks under one key of a pool's block map."""
        if wanted is not None and self._overlapping(wanted, nbytes) is None:
            return wanted
        address = self._next_synthetic_address
        self._next_synthetic_address = _round_up(address + nbytes, _LARGE_BUFFER)
        return address

    def _overlapping(self, address: int, nbytes: int) -> _Segment | None:
        """The segment over [address, address + nbytes), if any: segments are disjoint, so
        the last one starting before the end is the only candidate."""
        i = bisect.bisect_left(self._segment_starts, address + nbytes)
        if i == 0:
            return None
        segment = self._segments[self._segment_starts[i - 1]]
        return segment if segment.end > address else None

    def _add_segment(self, segment: _Segment) -> None:
        self.pools[segment.small].join(segment)
        bisect.insort(self._segment_starts, segment.address)
        self._segments[segment.address] = segment
        end = _round_up(segment.end, _LARGE_BUFFER)
        self._next_synthetic_address = max(self._next_synthetic_address, end)

    def _remove_segment(self, segment: _Segment) -> None:
        del self._segment_starts[bisect.bisect_left(self._segment_starts, segment.address)]
        del self._segments[segment.address]

    def _alloc_found_block(self, pool: _Pool, block: _Block, size: int) -> None:
        """alloc_found_block with should_split: the rest goes back to the pool."""
        rest = block.size - size
        if pool.small or self.settings.expandable_segments:
            split = rest >= _MIN_BLOCK
        else:
            max_split = self.settings.max_split_size_bytes
            split = (max_split is None or size < max_split) and rest > _SMALL_SIZE
        if split:
            tail = _Block(block.address + size, rest, block.segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            pool.insert(tail)
        block.allocated = True

    def _try_merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> None:
        """try_merge_blocks: a free neighbour of the same mapped state joins `dst`."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        pool.remove(src)
        if dst.prev is src:
            dst.address, dst.prev = src.address, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    # --- releasing ------------------------------------------------------------------------

    def _release_block(self, pool: _Pool, block: _Block) -> None:
        """release_block: cudaFree of a wholly free, non-expandable segment."""
        pool.remove(block)
        self._remove_segment(block.segment)
        self.reserved_bytes -= block.size
        self.num_segments -= 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int) -> bool:
        """release_available_cached_blocks (only with max_split_size): free the smallest
        oversize segment that holds the request, else oversize ones from the largest down
        until enough is freed."""
        max_split = self.settings.max_split_size_bytes
        if max_split is None:
            return False
        wanted = max(size, max_split)
        keys = pool.keys[stream]
        i = bisect.bisect_left(keys, (wanted, -1))
        if i < len(keys):
            return self._release_whole(pool, pool.blocks[keys[i][1]]) > 0
        released = 0
        for _, address in reversed(keys[:i]):
            block = pool.blocks[address]
            if released >= wanted or block.size < max_split:
                break
            released += self._release_whole(pool, block)
        return released >= wanted

    def _release_whole(self, pool: _Pool, block: _Block) -> int:
        # Blocks >= max_split_size are never split (should_split), so a cached one is a whole
        # segment; c10 asserts it is not expandable.
        if block.segment.expandable or block.prev is not None or block.next is not None:
            return 0
        self._release_block(pool, block)
        return block.size

    def _garbage_collect_cached_blocks(self) -> None:
        """garbage_collect_cached_blocks: past threshold x limit, free wholly free large
        segments cached for at least the average age (in get_free_block calls) until the
        excess is reclaimed."""
        threshold_bytes = int(self.settings.garbage_collection_threshold * self.limit_bytes)
        if self.reserved_bytes <= threshold_bytes:
            return
        target_bytes, reclaimed_bytes = self.reserved_bytes - threshold_bytes, 0
        pool = self.pools[False]
        ages = {
            b.address: pool.get_free_calls - b.gc_base
            for b in pool.blocks.values()
            if b.prev is None and b.next is None
        }
        while reclaimed_bytes < target_bytes and ages:
            age_threshold = sum(ages.values()) / len(ages)
            old = [b for b in pool.free_blocks() if ages.get(b.address, -1) >= age_threshold]
            for block in old:
                del ages[block.address]
                reclaimed_bytes += block.size
                self._release_block(pool, block)

    # --- expandable segments --------------------------------------------------------------

    def _try_allocate_expandable_block(
        self, pool: _Pool, size: int, stream: int, segment_address: int | None
    ) -> _Block | None:
        """try_allocate_expandable_block: map the pages the lowest fitting run of free and
        unmapped space lacks."""
        candidate = self._find_expandable_block(pool, size, stream, segment_address)
        if not candidate.mapped and not self._map_block(pool, candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next
            if not self._map_block(pool, nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(
        self, pool: _Pool, size: int, stream: int, segment_address: int | None
    ) -> _Block:
        """find_expandable_block: the stream's lowest unmapped block (with the free block
        before it) followed by enough free or unmapped space, else a new segment's address
        space for the stream."""
        for address in pool.unmapped[stream]:
            candidate = pool.unmapped_blocks[address]
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            room, block = 0, candidate
            while room < size and block is not None and not block.allocated:
                room, block = room + block.size, block.next
            if room >= size:
                return candidate
        va_bytes = self.expandable_va_bytes
        address = self._place(segment_address, va_bytes)
        segment = _Segment(address, va_bytes, pool.small, True, stream)
        self._add_segment(segment)
        block = _Block(segment.address, va_bytes, segment, mapped=False)
        pool.insert(block)
        return block

    def _map_block(self, pool: _Pool, block: _Block, nbytes: int) -> bool:
        """map_block: map whole pages from the start of an unmapped block, merge with free
        neighbours. Fails (cuMemCreate) past the device's memory."""
        page = block.segment.page_bytes
        offset = block.address - block.segment.address
        mapped_bytes = _round_up(offset + nbytes, page) - offset
        if self.device_bytes is not None and self.reserved_bytes + mapped_bytes > self.device_bytes:
            return False
        pool.remove(block)
        if mapped_bytes < block.size:
            rest = _Block(block.address + mapped_bytes, block.size - mapped_bytes, block.segment)
            rest.mapped, rest.prev, rest.next = False, block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, mapped_bytes
            pool.insert(rest)
        self.num_segments += 1 - _is_mapped(block.prev) - _is_mapped(block.next)
        block.mapped = True
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert(block)
        self._reserve(mapped_bytes)
        return True

    def _unmap_block(self, pool: _Pool, block: _Block) -> None:
        """unmap_block: unmap the whole pages inside a free block of an expandable segment."""
        base, page = block.segment.address, block.segment.page_bytes
        begin = base + _round_up(block.address - base, page)
        end = base + (block.address + block.size - base) // page * page
        if begin < end:
            self._unmap_pages(pool, block, begin, end)

    def _unmap_pages(self, pool: _Pool, block: _Block, begin: int, end: int) -> None:
        """Unmaps [begin, end), whole pages inside the free `block`; what the block holds
        before and after stays free and mapped."""
        pool.remove(block)
        if begin > block.address:  # prev? -> before -> block
            self._split_free(pool, block, begin - block.address, before=True)
        if block.address + block.size > end:  # block -> after -> next?
            self._split_free(pool, block, block.address + block.size - end, before=False)
        self.num_segments += _is_mapped(block.prev) + _is_mapped(block.next) - 1
        block.mapped = False
        self.reserved_bytes -= block.size
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert(block)

    def _split_free(self, pool: _Pool, block: _Block, nbytes: int, before: bool) -> None:
        if before:
            piece = _Block(block.address, nbytes, block.segment, prev=block.prev, next=block)
            if block.prev is not None:
                block.prev.next = piece
            block.prev, block.address = piece, block.address + nbytes
        else:
            piece = _Block(block.address + block.size - nbytes, nbytes, block.segment)
            piece.prev, piece.next = block, block.next
            if block.next is not None:
                block.next.prev = piece
            block.next = piece
        block.size -= nbytes
        pool.insert(piece)


def _is_mapped(block: _Block | None) -> int:
    return int(block is not None and block.mapped)


# ------------------------------------------------------------------------------ invariants


def _increasing(values: list) -> bool:
    return all(map(operator.lt, values, values[1:]))


@dataclass
class _Totals:
    """What the walk of every segment gives, to compare with the model's counters."""

    blocks: list[_Block] = field(default_factory=list)
    reserved_bytes: int = 0
    num_segments: int = 0  # as a snapshot counts: an expandable segment per mapped range

    def add(self, segment: _Segment, blocks: list[_Block]) -> None:
        self.blocks += blocks
        if not segment.expandable:
            self.reserved_bytes += segment.size_bytes
            self.num_segments += 1
            return
        for block in blocks:
            prev = block.prev
            if block.mapped:
                self.reserved_bytes += block.size
                self.num_segments += prev is None or not prev.mapped
            if prev is not None and prev.mapped != block.mapped:
                offset = block.address - segment.address  # c10 maps whole pages
                assert offset % segment.page_bytes == 0, (
                    f"mapped space of the segment at {segment.address:#x} starts or ends at "
                    f"offset {offset:#x}, off a page boundary"
                )


def _segment_blocks(segment: _Segment, block: _Block | None) -> list[_Block]:
    """A segment's blocks by their next links from the one at its address, checked to tile
    it: each starts where the last ended, links back to it and names the segment."""
    assert block is not None, f"no block at the segment at {segment.address:#x}"
    blocks, cursor, prev = [], segment.address, None
    while block is not None:
        assert (
            block.address == cursor
            and block.size > 0
            and block.prev is prev
            and block.segment is segment
        ), f"the segment at {segment.address:#x} breaks at {cursor:#x}: {block}"
        blocks.append(block)
        cursor += block.size
        prev, block = block, block.next
    assert cursor == segment.end, (
        f"the blocks of the segment at {segment.address:#x} end at {cursor:#x}, "
        f"it at {segment.end:#x}"
    )
    return blocks


def _check_blocks(model: CachingAllocatorModel, totals: _Totals) -> None:
    """The walked blocks against the live keys and the pools' maps: allocated ones are the
    live ones, free mapped ones those of the maps, unmapped ones (only in expandable
    segments) those of the unmapped maps, each map keyed by its blocks' addresses and
    holding its pool's; and no two free neighbours share a mapped state."""
    blocks = totals.blocks
    allocated = [b for b in blocks if b.allocated]
    assert _same_blocks(allocated, model.live.values()), (
        f"{len(allocated)} allocated blocks in the segments, {len(model.live)} live keys, "
        "not the same blocks"
    )
    assert all(b.mapped for b in allocated), "an allocated block is unmapped"
    for mapped in (True, False):
        walked = [b for b in blocks if not b.allocated and b.mapped == mapped]
        maps = [p.blocks if mapped else p.unmapped_blocks for p in model.pools.values()]
        kind = "free mapped" if mapped else "unmapped"
        assert _same_blocks(walked, [b for m in maps for b in m.values()]), (
            f"{len(walked)} {kind} blocks in the segments, {sum(map(len, maps))} in the pools"
        )
        for pool, blocks_at in zip(model.pools.values(), maps, strict=True):
            assert all(
                a == b.address and b.segment.small == pool.small for a, b in blocks_at.items()
            ), (
                f"{'small' if pool.small else 'large'} pool: a {kind} block under another "
                "address or of the other pool"
            )
    assert all(b.segment.expandable for b in blocks if not b.mapped), (
        "an unmapped block in a plain segment"
    )
    unmerged = [
        b
        for b in blocks
        if not b.allocated and b.next is not None and not b.next.allocated
        if b.next.mapped == b.mapped
    ]
    assert not unmerged, f"free neighbours of one mapped state, unmerged: {unmerged[0]}"


def _same_blocks(these: list[_Block], those: Iterable[_Block]) -> bool:
    """The same block objects, each once."""
    those = list(those)
    return len(these) == len(those) == len(set(map(id, these)) & set(map(id, those)))


def _check_index(pool: _Pool) -> None:
    """The sorted indexes against the maps (which the walk matched with the blocks): as
    many entries, each stream's sorted without repeats, each naming a block of its size on
    its stream."""
    name = "small" if pool.small else "large"
    num_keys = sum(map(len, pool.keys.values()))
    assert num_keys == len(pool.blocks), (
        f"{name} pool: {num_keys} index keys, {len(pool.blocks)} free blocks in its map"
    )
    for stream, keys in pool.keys.items():
        assert _increasing(keys), f"{name} pool, stream {stream}: index out of order or repeated"
        for size, address in keys:
            block = pool.blocks.get(address)
            assert block is not None and (block.size, block.segment.stream) == (size, stream), (
                f"{name} pool, stream {stream}: index key ({size}, {address:#x}) names no free "
                "block of that size on that stream"
            )
    num_unmapped = sum(map(len, pool.unmapped.values()))
    assert num_unmapped == len(pool.unmapped_blocks), (
        f"{name} pool: {num_unmapped} unmapped keys, {len(pool.unmapped_blocks)} in its map"
    )
    for stream, unmapped in pool.unmapped.items():
        assert _increasing(unmapped), f"{name} pool, stream {stream}: unmapped index out of order"
        assert all(
            a in pool.unmapped_blocks and pool.unmapped_blocks[a].segment.stream == stream
            for a in unmapped
        ), f"{name} pool, stream {stream}: an unmapped key names no unmapped block of the stream"


# ------------------------------------------------------------------------------ replaying


def replay(model: CachingAllocatorModel, events: Iterable[tuple[object, int]]) -> None:
    """Runs `(key, nbytes)` allocations and `(key, -1)` frees; raises AllocatorOutOfMemory."""
    _replay_rounded(model, _rounded(events, model.settings))


def _rounded(
    events: Iterable[tuple[object, int]], settings: AllocatorSettings
) -> list[tuple[object, int]]:
    """The events with each allocation's size rounded as the allocator rounds it (the
    block's size): once for the several runs of a bisection."""
    round_size = settings.round_size
    return [(key, round_size(nbytes) if nbytes >= 0 else -1) for key, nbytes in events]


def _replay_rounded(model: CachingAllocatorModel, events: list[tuple[object, int]]) -> None:
    """replay of events _rounded gave."""
    malloc, free = model._malloc_block, model.free
    for key, size in events:
        if size < 0:
            free(key)
        else:
            malloc(key, size)


def live_peak_bytes(
    events: Iterable[tuple[object, int]],
    round_size: Callable[[int], int] = int,
    live_blocks: Iterable[tuple[object, int]] = (),
) -> int:
    """The peak of the live bytes of `(key, nbytes)` / `(key, -1)` events, each allocation
    rounded by `round_size` (AllocatorSettings.round_size: the blocks' sizes, which no limit
    below can hold; unrounded: the tracker's live tensor bytes), from `live_blocks` already
    live."""
    sizes = dict(live_blocks)
    live = peak = sum(sizes.values())
    for key, nbytes in events:
        if nbytes < 0:
            live -= sizes.pop(key)
        else:
            sizes[key] = round_size(nbytes)
            live += sizes[key]
            peak = max(peak, live)
    return peak


def smallest_fitting_limit(
    fits: Callable[[int], bool | int | None], low_bytes: int, high_bytes: int
) -> int:
    """Bisection over multiples of LIMIT_RESOLUTION_BYTES (exact: every amount c10 compares
    with the limit is one, so whether a step fits changes only there): the smallest limit in
    (low_bytes, high_bytes] that `fits`, given that `high_bytes` does. Assumes fitting is
    monotone in the limit, which c10's release-and-retry makes it nearly always. `fits` may
    answer with the peak reserved under the limit instead of True: every limit from that
    peak up runs the step the same way (see _peak_under), so the search continues below it."""
    low = low_bytes // LIMIT_RESOLUTION_BYTES  # in units; fails (or is the floor)
    high = _round_up(high_bytes, LIMIT_RESOLUTION_BYTES) // LIMIT_RESOLUTION_BYTES
    while high - low > 1:
        middle = (low + high) // 2
        found = fits(middle * LIMIT_RESOLUTION_BYTES)
        if found is True:
            high = middle
        elif found:
            high = min(middle, _round_up(found, LIMIT_RESOLUTION_BYTES) // LIMIT_RESOLUTION_BYTES)
            high = max(high, low + 1)
        else:
            low = middle
    return high * LIMIT_RESOLUTION_BYTES


class _Runs:
    """One step's runs under several limits (a bisection's), each started from the latest
    state it shares with the run without a limit rather than from the first event. A run
    under a limit L is the unlimited run, event for event, until the first new segment c10
    would refuse under L (alloc_block's check: reserved + segment > L; nothing else in
    c10's malloc and free reads the limit, garbage collection aside, which then runs every
    limit from the start): the unlimited run records every such check, and a run keeps a
    copy of the state before the event where it diverges, for the runs under nearby limits
    that diverge there too. A bisection's runs diverge near the step's peak, mostly past
    half its events, and the runs that fail there stop soon after."""

    def __init__(self, steps: list[tuple[object, int]], settings: AllocatorSettings) -> None:
        self.steps, self.settings = steps, settings
        unlimited = self.unlimited = CachingAllocatorModel(settings)
        checks: list[tuple[int, int]] = []
        unlimited._checks = checks
        malloc, free = unlimited._malloc_block, unlimited.free
        for i, (key, size) in enumerate(steps):
            if size < 0:
                free(key)
            else:
                unlimited._at = i
                malloc(key, size)
        unlimited._checks = None
        self._events = [i for i, _ in checks]
        # the largest reserve + segment checked up to each check: a run under L diverges at
        # the first check where it passes L
        self._needs = list(itertools.accumulate((need for _, need in checks), max))
        self._shared = settings.garbage_collection_threshold == 0
        self._states = {0: CachingAllocatorModel(settings)}  # event -> the state before it

    def under(self, limit_bytes: int) -> CachingAllocatorModel | None:
        """The state after the step under `limit_bytes`; None when it runs out of memory."""
        if not self._shared:
            start, model = 0, CachingAllocatorModel(self.settings, limit_bytes)
        else:
            found = bisect.bisect_right(self._needs, limit_bytes)
            if found == len(self._needs):
                return self.unlimited  # no check reaches the limit: the same run
            diverges = self._events[found]
            start = max(i for i in self._states if i <= diverges)
            model = self._states[start].copy()
            model.limit_bytes = limit_bytes
            _replay_rounded(model, self.steps[start:diverges])  # no check fails before
            if diverges not in self._states:
                self._states[diverges] = model.copy()
            start = diverges
        try:
            _replay_rounded(model, self.steps[start:])
        except AllocatorOutOfMemory:
            return None
        return model

    def peak_under(self, limit_bytes: int) -> bool | int:
        """Whether the step runs under `limit_bytes`: False, or its peak reserve there when
        every limit from that peak up runs it the same way, else True. A run under a limit
        differs from one under another only where c10 compares `reserved + segment` with
        it: a comparison that failed (> limit) fails under any smaller limit, one that
        passed was at most the peak, so every limit from the peak up decides alike. Not so
        with expandable segments (the comparison counts a whole segment, the reserve only
        the pages mapped) or garbage collection (a share of the limit)."""
        model = self.under(limit_bytes)
        if model is None:
            return False
        if self.settings.expandable_segments or not self._shared:
            return True
        return model.peak_reserved_bytes

    def smallest_limit(self) -> int:
        """smallest_limit of these steps."""
        high = self.unlimited.peak_reserved_bytes + expandable_slack_bytes(
            self.steps, self.settings
        )
        return smallest_fitting_limit(self.peak_under, live_peak_bytes(self.steps) - 1, high)


def _workspace_events(workspaces: Iterable[int]) -> list[tuple[object, int]]:
    return [(("cublas-workspace", i), nbytes) for i, nbytes in enumerate(workspaces)]


def smallest_limit(
    events: list[tuple[object, int]],
    settings: AllocatorSettings,
    workspaces: Iterable[int] = (),
) -> int:
    """The smallest per-process limit (bytes, exact to 2 MiB, see smallest_fitting_limit)
    under which the step, after the cuBLAS workspaces, runs without an out-of-memory error."""
    steps = _workspace_events(workspaces) + list(events)
    if settings.backend == "cudaMallocAsync":
        return _async_reserved_bytes(steps)
    return _Runs(_rounded(steps, settings), settings).smallest_limit()


def expandable_slack_bytes(
    events: Iterable[tuple[object, int]], settings: AllocatorSettings
) -> int:
    """With expandable segments alloc_block checks a whole get_allocation_size against the
    limit but may map less: the unlimited peak plus the largest such size always fits."""
    if not settings.expandable_segments:
        return 0
    return max((allocation_size(settings.round_size(n)) for _, n in events if n >= 0), default=0)


def _async_reserved_bytes(events: Iterable[tuple[object, int]]) -> int:
    """cudaMallocAsync: CUDA's pool, not c10's cache, so no segments to model; its reserve
    grows in 2 MiB chunks of physical memory and, with torch's release threshold, gives
    unused chunks back, so the live peak (512 B aligned) rounded to 2 MiB is the prediction
    (a lower bound: fragmentation inside the driver's pool is not modelled)."""
    peak = live_peak_bytes(events, AllocatorSettings().round_size)
    return _round_up(peak, LIMIT_RESOLUTION_BYTES)


@dataclass(frozen=True)
class CudaReserve:
    """What the allocator reserves for a step: unlimited, the least limit it runs in, and
    under the given limit (None: out of memory there)."""

    peak_reserved_bytes_unlimited: int
    smallest_limit_bytes: int
    peak_reserved_under_limit_bytes: int | None


def predict_reserved(
    events: list[tuple[object, int]],
    settings: AllocatorSettings,
    workspaces: Iterable[int] = (),
    limit_bytes: int | None = None,
) -> CudaReserve:
    """The predictor's figures for a tracked step (cuBLAS workspaces allocated first: they
    live from the first matmul on). With cudaMallocAsync every figure is the live peak
    rounded to 2 MiB (_async_reserved_bytes)."""
    workspaces = list(workspaces)
    steps = _workspace_events(workspaces) + list(events)
    if settings.backend == "cudaMallocAsync":
        peak = _async_reserved_bytes(steps)
        under = peak if limit_bytes is None or peak <= limit_bytes else None
        return CudaReserve(peak, peak, under)
    runs = _Runs(_rounded(steps, settings), settings)
    peak = under = runs.unlimited.peak_reserved_bytes
    if limit_bytes is not None:
        limited = runs.under(limit_bytes)
        under = None if limited is None else limited.peak_reserved_bytes
    least = runs.smallest_limit()
    return CudaReserve(peak, least, under)


# ------------------------------------------------------------------------------ cuBLAS


def cublas_workspaces(
    capability: tuple[int, int], training: bool, environ: Mapping[str, str] = os.environ
) -> tuple[int, ...]:
    """The cuBLAS workspaces the caching allocator holds for a step, one per (handle, stream)
    (CublasHandlePool.cpp's setWorkspaceForHandle): the main thread's handle, and in training
    the autograd device thread's own handle for the backward matmuls. Each is
    getChosenWorkspaceSize: CUBLAS_WORKSPACE_CONFIG (`:SIZE_KiB:COUNT` pairs) if set, else
    32 MiB on sm 9.0 and 4096 KiB x 2 + 16 KiB x 8 elsewhere. cuBLASLt's workspace is not
    counted: it is 1 MiB, and none shows in the traces of tests/fixtures/cuda-traces."""
    num_handles = 2 if training else 1
    return (_chosen_workspace_bytes(capability, environ),) * num_handles


def _chosen_workspace_bytes(capability: tuple[int, int], environ: Mapping[str, str]) -> int:
    config = environ.get("CUBLAS_WORKSPACE_CONFIG")
    default = 4096 * 8 * KiB if tuple(capability) == (9, 0) else (4096 * 2 + 16 * 8) * KiB
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:  # torch warns and uses the default
        return default
    return sum(int(size) * KiB * int(count) for size, count in pairs)
