"""The state of the caching allocator model (train/memory/allocator.py), as c10 keeps it:
segments, the blocks that tile each one (linked by address), and the pools that index the
free blocks (c10's Block and BlockPool); the operations on blocks that count no bytes
(splitting, merging, a seeded segment's blocks, a copy of the whole state); and the
invariants among them (`check_blocks`: for tests and debugging, the model's `check` reads its
counters against what it walked). How many bytes are reserved, and when segments come and go,
is the model's business."""

from __future__ import annotations

import bisect
import itertools
import operator
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from batchfit.train.device.allocator_settings import LARGE_BUFFER_BYTES, SMALL_BUFFER_BYTES

Piece = tuple[int, int, bool, bool]  # a block to link: address, size, allocated, mapped


@dataclass(eq=False, slots=True)
class Segment:
    address: int
    size_bytes: int  # the address space of an expandable segment
    small: bool
    expandable: bool
    stream: int  # the stream that allocated it: its blocks serve that stream only
    # Its pool's sorted keys of the stream's free and unmapped blocks (BlockPool.keys[stream],
    # BlockPool.unmapped[stream]), held here so that caching a block looks up no stream.
    free_keys: list[tuple[int, int]] = field(default_factory=list, repr=False)
    unmapped_keys: list[int] = field(default_factory=list, repr=False)

    @property
    def page_bytes(self) -> int:
        return SMALL_BUFFER_BYTES if self.small else LARGE_BUFFER_BYTES

    @property
    def end(self) -> int:
        return self.address + self.size_bytes


@dataclass(eq=False, slots=True)
class Block:
    address: int
    size: int
    segment: Segment
    prev: Block | None = None
    next: Block | None = None
    allocated: bool = False
    mapped: bool = True
    gc_base: int = 0  # the pool's get_free_block count when it was cached (c10 gc_count_base)


def expandable_size(block: Block) -> int:
    """get_free_block's expandable_size: a free block followed by unmapped space can grow."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


@dataclass(eq=False)
class BlockPool:
    """A BlockPool: free mapped blocks by stream, then (size, address) (BlockComparatorSize),
    unmapped ones by stream, then address (BlockComparatorAddress): a sorted list per stream.
    `blocks` and `unmapped_blocks` map an address to its block: no two segments the model
    holds overlap (CachingAllocatorModel._place), so no two blocks share one."""

    small: bool
    keys: defaultdict[int, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    blocks: dict[int, Block] = field(default_factory=dict)
    unmapped: defaultdict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    unmapped_blocks: dict[int, Block] = field(default_factory=dict)
    get_free_calls: int = 0

    def join(self, segment: Segment) -> None:
        """A new segment of the pool shares its stream's sorted keys."""
        segment.free_keys = self.keys[segment.stream]
        segment.unmapped_keys = self.unmapped[segment.stream]

    def insert(self, block: Block) -> None:
        if block.mapped:
            block.gc_base = self.get_free_calls
            bisect.insort(block.segment.free_keys, (block.size, block.address))
            self.blocks[block.address] = block
        else:
            bisect.insort(block.segment.unmapped_keys, block.address)
            self.unmapped_blocks[block.address] = block

    def remove(self, block: Block) -> None:
        if block.mapped:
            keys = block.segment.free_keys
            del keys[bisect.bisect_left(keys, (block.size, block.address))]
            del self.blocks[block.address]
        else:
            unmapped = block.segment.unmapped_keys
            del unmapped[bisect.bisect_left(unmapped, block.address)]
            del self.unmapped_blocks[block.address]

    def free_blocks(self) -> list[Block]:
        """The free mapped blocks in c10's order: by stream, size, address."""
        return [self.blocks[a] for stream in sorted(self.keys) for _, a in self.keys[stream]]

    def split(self, block: Block, size: int) -> None:
        """`block` (in no index) keeps its first `size` bytes; the rest becomes a free block
        after it, mapped as it is, and goes to the index (alloc_found_block's split)."""
        rest = Block(block.address + size, block.size - size, block.segment, block, block.next)
        rest.mapped = block.mapped
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        self.insert(rest)

    def split_before(self, block: Block, nbytes: int) -> None:
        """`block` (in no index) gives its first `nbytes` to a free block before it, mapped
        as it is, which goes to the index."""
        piece = Block(block.address, nbytes, block.segment, block.prev, block)
        piece.mapped = block.mapped
        if block.prev is not None:
            block.prev.next = piece
        block.prev, block.address = piece, block.address + nbytes
        block.size -= nbytes
        self.insert(piece)

    def merge(self, dst: Block, src: Block | None) -> None:
        """try_merge_blocks: a free neighbour of the same mapped state joins `dst`."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        self.remove(src)
        if dst.prev is src:
            dst.address, dst.prev = src.address, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def link(self, segment: Segment, pieces: list[Piece]) -> list[Block]:
        """The blocks of `pieces`, linked in order, the free ones cached here; returns the
        allocated ones."""
        allocated, prev = [], None
        for address, size, is_allocated, mapped in pieces:
            block = Block(address, size, segment, prev=prev, allocated=is_allocated, mapped=mapped)
            if prev is not None:
                prev.next = block
            if is_allocated:
                allocated.append(block)
            else:
                self.insert(block)
            prev = block
        return allocated


def seeded_pieces(
    segment: Segment, mapped: list[tuple[int, int]], live: list[tuple[int, int]]
) -> list[Piece]:
    """Blocks of a seeded segment: live blocks, free gaps, unmapped space between the
    mapped `(address, size)` ranges of an expandable one; `live` is sorted."""
    pieces: list[Piece] = []
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
    if segment.end > cursor:
        pieces.append((cursor, segment.end - cursor, False, False))
    return pieces


def copy_state(
    segments: dict[int, Segment], pools: dict[bool, BlockPool], live: dict[object, Block]
) -> tuple[dict[int, Segment], dict[bool, BlockPool], dict[object, Block]]:
    """An independent copy of the segments (by address), the pools and the live blocks (by
    key), its blocks linked as these are."""
    new_segments = {
        address: Segment(s.address, s.size_bytes, s.small, s.expandable, s.stream)
        for address, s in segments.items()
    }
    new_pools = {}
    for small, pool in pools.items():
        copied = new_pools[small] = BlockPool(small=small, get_free_calls=pool.get_free_calls)
        for stream, keys in pool.keys.items():
            copied.keys[stream] = list(keys)
        for stream, unmapped in pool.unmapped.items():
            copied.unmapped[stream] = list(unmapped)
    for segment in new_segments.values():
        new_pools[segment.small].join(segment)
    blocks: dict[int, Block] = {}  # id of a block here -> its copy
    for block in itertools.chain(
        live.values(),
        *(pool.blocks.values() for pool in pools.values()),
        *(pool.unmapped_blocks.values() for pool in pools.values()),
    ):
        blocks[id(block)] = Block(
            block.address,
            block.size,
            new_segments[block.segment.address],
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
    for small, pool in pools.items():
        copied = new_pools[small]
        copied.blocks = {a: blocks[id(b)] for a, b in pool.blocks.items()}
        copied.unmapped_blocks = {a: blocks[id(b)] for a, b in pool.unmapped_blocks.items()}
    new_live = {key: blocks[id(block)] for key, block in live.items()}
    return new_segments, new_pools, new_live


# ------------------------------------------------------------------------------ invariants


def check_blocks(
    segment_starts: list[int],
    segments: dict[int, Segment],
    pools: dict[bool, BlockPool],
    live: dict[object, Block],
) -> Totals:
    """Raises AssertionError naming the first broken invariant among the blocks, read from
    the blocks themselves: every segment, walked by its links, is tiled by its blocks; each
    free block is in its pool's index once and the index holds nothing else; no two free
    neighbours of one mapped state (they merge); the `live` keys name the allocated blocks;
    no two segments overlap. Returns what the walk counted. O(blocks)."""
    assert segment_starts == sorted(segments), (
        "the sorted segment addresses and the segment map disagree"
    )
    live_at = {b.address: b for b in live.values()}
    totals, previous = Totals(), None
    for address in segment_starts:
        segment = segments[address]
        assert previous is None or previous.end <= address, (
            f"the segments at {previous.address:#x} ({previous.size_bytes} bytes) and "
            f"{address:#x} overlap"
        )
        pool = pools[segment.small]
        assert (
            segment.free_keys is pool.keys[segment.stream]
            and segment.unmapped_keys is pool.unmapped[segment.stream]
        ), f"the segment at {address:#x} holds another index than its stream's"
        head = live_at.get(address) or pool.blocks.get(address)
        totals.add(segment, _segment_blocks(segment, head or pool.unmapped_blocks.get(address)))
        previous = segment
    _check_blocks(totals, pools, live)
    for pool in pools.values():
        _check_index(pool)
    return totals


def _increasing(values: list) -> bool:
    return all(map(operator.lt, values, values[1:]))


@dataclass
class Totals:
    """What the walk of every segment gives, to compare with the model's counters."""

    blocks: list[Block] = field(default_factory=list)
    reserved_bytes: int = 0
    num_segments: int = 0  # as a snapshot counts: an expandable segment per mapped range

    def add(self, segment: Segment, blocks: list[Block]) -> None:
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


def _segment_blocks(segment: Segment, block: Block | None) -> list[Block]:
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


def _check_blocks(totals: Totals, pools: dict[bool, BlockPool], live: dict[object, Block]) -> None:
    """The walked blocks against the live keys and the pools' maps: allocated ones are the
    live ones, free mapped ones those of the maps, unmapped ones (only in expandable
    segments) those of the unmapped maps, each map keyed by its blocks' addresses and
    holding its pool's; and no two free neighbours share a mapped state."""
    blocks = totals.blocks
    allocated = [b for b in blocks if b.allocated]
    assert _same_blocks(allocated, live.values()), (
        f"{len(allocated)} allocated blocks in the segments, {len(live)} live keys, "
        "not the same blocks"
    )
    assert all(b.mapped for b in allocated), "an allocated block is unmapped"
    for mapped in (True, False):
        walked = [b for b in blocks if not b.allocated and b.mapped == mapped]
        maps = [p.blocks if mapped else p.unmapped_blocks for p in pools.values()]
        kind = "free mapped" if mapped else "unmapped"
        assert _same_blocks(walked, [b for m in maps for b in m.values()]), (
            f"{len(walked)} {kind} blocks in the segments, {sum(map(len, maps))} in the pools"
        )
        for pool, blocks_at in zip(pools.values(), maps, strict=True):
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


def _same_blocks(these: list[Block], those: Iterable[Block]) -> bool:
    """The same block objects, each once."""
    those = list(those)
    return len(these) == len(those) == len(set(map(id, these)) & set(map(id, those)))


def _check_index(pool: BlockPool) -> None:
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
