"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), as far as it
decides how much memory a step *reserves*: the figure a CUDA prediction is compared with the
budget by. It replays a step's allocations and frees (`(key, nbytes)` and `(key, -1)`) through
c10's rules: block rounding, best fit by (size, address), splitting, merging, new segments,
expandable segments, max_split_size, garbage collection and, under a per-process limit, c10's
release-and-retry before an out-of-memory error. Its settings are
train/device/allocator_settings.py, the segments, blocks and pools it keeps
train/memory/allocator_blocks.py; train/memory/reserve.py replays a step through it (what the
predictor calls), and `bench/gpu/cuda_trace.py` checks it event by event against real CUDA traces.

Blocks serve only the CUDA stream that allocated their segment, as in c10; `empty_cache` is
`release_cached_blocks`, and a trace's segment_free / segment_unmap are `release_segment` /
`unmap`. No CUDA graphs (private pools) and no record_stream (a free is final)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from batchfit.train.device.allocator_settings import (
    LARGE_BUFFER_BYTES,
    MIN_BLOCK_BYTES,
    ROUND_LARGE_BYTES,
    SMALL_SIZE_BYTES,
    AllocatorSettings,
    allocation_size,
    round_up,
)
from batchfit.train.memory.allocator_blocks import (
    Block,
    BlockPool,
    Segment,
    Totals,
    check_blocks,
    copy_state,
    expandable_size,
    seeded_pieces,
)

# Address space of an expandable segment when the device's size is not given: c10 reserves
# 9/8 of the device (find_expandable_block); it only has to exceed any hole unmapping leaves.
_EXPANDABLE_VA_BYTES = 1 << 40
_SYNTHETIC_BASE = 1 << 48  # new segments without a caller's address go above any real one
# Under a limit alloc_block checks get_allocation_size (a large request rounded to 2 MiB) but
# an expandable segment maps whole 20 MiB pages: it may end up to 18 MiB over the limit.
_EXPANDABLE_LIMIT_SLACK = LARGE_BUFFER_BYTES - ROUND_LARGE_BYTES


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
        self.pools = {True: BlockPool(small=True), False: BlockPool(small=False)}
        self.live: dict[object, Block] = {}
        self.reserved_bytes = 0
        self.peak_reserved_bytes = 0
        self.num_segments = 0  # as a snapshot counts: an expandable one per mapped range
        self._segments: dict[int, Segment] = {}  # by address; never two over one byte
        self._segment_starts: list[int] = []  # their addresses, sorted
        self._seed_reserved_bytes = 0  # a seeded state may be over the limit
        self._next_synthetic_address = _SYNTHETIC_BASE
        self._gc = limit_bytes is not None and self.settings.garbage_collection_threshold > 0
        # While a list (reserve.py's _Runs), each alloc_block's limit check, as
        # (event_index, reserved + segment)
        self.limit_checks: list[tuple[int, int]] | None = None
        self.event_index = 0  # the event being replayed, for limit_checks

    @property
    def expandable_va_bytes(self) -> int:
        if self.device_bytes is None:
            return _EXPANDABLE_VA_BYTES
        return round_up(self.device_bytes + self.device_bytes // 8, LARGE_BUFFER_BYTES)

    # --- the public operations -------------------------------------------------------

    def malloc(
        self, key: object, nbytes: int, segment_address: int | None = None, stream: int = 0
    ) -> int:
        """c10's malloc on `stream` (a free block serves the stream its segment was allocated
        on only); returns the block's address. `segment_address` is where a new segment goes
        if one is needed (a trace's segment_alloc), else a synthetic one; also a synthetic
        one when the model holds a segment over that range (see _place)."""
        return self.malloc_rounded(key, self.settings.round_size(nbytes), segment_address, stream)

    def malloc_rounded(
        self, key: object, size: int, segment_address: int | None = None, stream: int = 0
    ) -> int:
        """malloc of a size round_size gave (a replay rounds each size once, not per run)."""
        pool = self.pools[size <= SMALL_SIZE_BYTES]
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
        pool.merge(block, block.prev)
        pool.merge(block, block.next)
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
        by_segment: dict[int, list[Block]] = {}
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
        new._segments, new.pools, new.live = copy_state(self._segments, self.pools, self.live)
        new._segment_starts = list(self._segment_starts)
        return new

    def check(self) -> None:
        """Raises AssertionError naming the first broken invariant, read from the blocks
        themselves: every segment, walked by its links, is tiled by its blocks; each free
        block is in its pool's index once and the index holds nothing else; no two free
        neighbours of one mapped state (they merge); the live keys name the allocated
        blocks; no two segments overlap; the reserved bytes, segment count and peak agree
        with the blocks; the limit and the device's memory hold. For tests and debugging:
        O(blocks), and malloc and free never call it."""
        totals = check_blocks(self._segment_starts, self._segments, self.pools, self.live)
        self._check_totals(totals)

    def _check_totals(self, totals: Totals) -> None:
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
            segment = Segment(state.address, state.size_bytes, state.small, False, state.stream)
            self._add_seeded(segment, [(state.address, state.size_bytes)], live)
        starts = sorted(s.address for s in segments)
        for (small, stream), ranges in sorted(expandable.items()):
            ranges.sort()
            # The address space runs to the next segment at most: c10 reserved it apart.
            start, last_end = ranges[0][0], ranges[-1][0] + ranges[-1][1]
            following = starts[bisect.bisect_right(starts, ranges[-1][0]) :]
            room = (following[0] if following else start + self.expandable_va_bytes) - start
            va_bytes = max(min(self.expandable_va_bytes, room), last_end - start)
            self._add_seeded(Segment(start, va_bytes, small, True, stream), ranges, live)
        self._seed_reserved_bytes = self.reserved_bytes

    def _add_seeded(self, segment: Segment, mapped: list[tuple[int, int]], live: list) -> None:
        if self._overlapping(segment.address, segment.size_bytes) is not None:
            raise ValueError(
                f"seeded segment at {segment.address:#x} of {segment.size_bytes} bytes overlaps "
                f"{self._overlapping(segment.address, segment.size_bytes)}; give disjoint segments"
            )
        self._add_segment(segment)
        for block in self.pools[segment.small].link(segment, seeded_pieces(segment, mapped, live)):
            self.live[block.address] = block
        self._reserve(sum(size for _, size in mapped))
        self.num_segments += len(mapped)

    # --- c10's malloc path ----------------------------------------------------------------

    def _get_free_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
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
                if expandable_size(nxt) >= expandable_size(block):
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
        self, pool: BlockPool, size: int, stream: int, segment_address: int | None
    ) -> Block:
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
        self, pool: BlockPool, size: int, stream: int, segment_address: int | None
    ) -> Block | None:
        """alloc_block: the per-process limit is checked against get_allocation_size even
        with expandable segments (which then map only the pages they lack)."""
        segment_bytes = allocation_size(size)
        if self.limit_checks is not None:
            self.limit_checks.append((self.event_index, self.reserved_bytes + segment_bytes))
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
        segment = Segment(address, segment_bytes, pool.small, False, stream)
        self._add_segment(segment)
        self._reserve(segment_bytes)
        self.num_segments += 1
        return Block(address, segment_bytes, segment)

    def _place(self, wanted: int | None, nbytes: int) -> int:
        """A new segment's address: the caller's unless the model holds a segment over any
        of that range (the real allocator released a segment there that the model keeps, or
        placed differently), else a synthetic one above every segment. Two segments over one
        address would put two free blocks under one key of a pool's block map."""
        if wanted is not None and self._overlapping(wanted, nbytes) is None:
            return wanted
        address = self._next_synthetic_address
        self._next_synthetic_address = round_up(address + nbytes, LARGE_BUFFER_BYTES)
        return address

    def _overlapping(self, address: int, nbytes: int) -> Segment | None:
        """The segment over [address, address + nbytes), if any: segments are disjoint, so
        the last one starting before the end is the only candidate."""
        i = bisect.bisect_left(self._segment_starts, address + nbytes)
        if i == 0:
            return None
        segment = self._segments[self._segment_starts[i - 1]]
        return segment if segment.end > address else None

    def _add_segment(self, segment: Segment) -> None:
        self.pools[segment.small].join(segment)
        bisect.insort(self._segment_starts, segment.address)
        self._segments[segment.address] = segment
        end = round_up(segment.end, LARGE_BUFFER_BYTES)
        self._next_synthetic_address = max(self._next_synthetic_address, end)

    def _remove_segment(self, segment: Segment) -> None:
        del self._segment_starts[bisect.bisect_left(self._segment_starts, segment.address)]
        del self._segments[segment.address]

    def _alloc_found_block(self, pool: BlockPool, block: Block, size: int) -> None:
        """alloc_found_block with should_split: the rest goes back to the pool."""
        rest = block.size - size
        if pool.small or self.settings.expandable_segments:
            split = rest >= MIN_BLOCK_BYTES
        else:
            max_split = self.settings.max_split_size_bytes
            split = (max_split is None or size < max_split) and rest > SMALL_SIZE_BYTES
        if split:
            pool.split(block, size)
        block.allocated = True

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    # --- releasing ------------------------------------------------------------------------

    def _release_block(self, pool: BlockPool, block: Block) -> None:
        """release_block: cudaFree of a wholly free, non-expandable segment."""
        pool.remove(block)
        self._remove_segment(block.segment)
        self.reserved_bytes -= block.size
        self.num_segments -= 1

    def _release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int) -> bool:
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

    def _release_whole(self, pool: BlockPool, block: Block) -> int:
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
        self, pool: BlockPool, size: int, stream: int, segment_address: int | None
    ) -> Block | None:
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
        self, pool: BlockPool, size: int, stream: int, segment_address: int | None
    ) -> Block:
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
        segment = Segment(address, va_bytes, pool.small, True, stream)
        self._add_segment(segment)
        block = Block(segment.address, va_bytes, segment, mapped=False)
        pool.insert(block)
        return block

    def _map_block(self, pool: BlockPool, block: Block, nbytes: int) -> bool:
        """map_block: map whole pages from the start of an unmapped block, merge with free
        neighbours. Fails (cuMemCreate) past the device's memory."""
        page = block.segment.page_bytes
        offset = block.address - block.segment.address
        mapped_bytes = round_up(offset + nbytes, page) - offset
        if self.device_bytes is not None and self.reserved_bytes + mapped_bytes > self.device_bytes:
            return False
        pool.remove(block)
        if mapped_bytes < block.size:  # the rest stays unmapped
            pool.split(block, mapped_bytes)
        self.num_segments += 1 - _is_mapped(block.prev) - _is_mapped(block.next)
        block.mapped = True
        pool.merge(block, block.prev)
        pool.merge(block, block.next)
        pool.insert(block)
        self._reserve(mapped_bytes)
        return True

    def _unmap_block(self, pool: BlockPool, block: Block) -> None:
        """unmap_block: unmap the whole pages inside a free block of an expandable segment."""
        base, page = block.segment.address, block.segment.page_bytes
        begin = base + round_up(block.address - base, page)
        end = base + (block.address + block.size - base) // page * page
        if begin < end:
            self._unmap_pages(pool, block, begin, end)

    def _unmap_pages(self, pool: BlockPool, block: Block, begin: int, end: int) -> None:
        """Unmaps [begin, end), whole pages inside the free `block`; what the block holds
        before and after stays free and mapped."""
        pool.remove(block)
        if begin > block.address:  # prev? -> before -> block
            pool.split_before(block, begin - block.address)
        if block.address + block.size > end:  # block -> after -> next?
            pool.split(block, end - block.address)
        self.num_segments += _is_mapped(block.prev) + _is_mapped(block.next) - 1
        block.mapped = False
        self.reserved_bytes -= block.size
        pool.merge(block, block.prev)
        pool.merge(block, block.next)
        pool.insert(block)


def _is_mapped(block: Block | None) -> int:
    return int(block is not None and block.mapped)
