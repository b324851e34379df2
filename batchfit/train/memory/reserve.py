"""What the CUDA caching allocator reserves for a step, from its events (`(key, nbytes)`
allocations, `(key, -1)` frees) replayed through the model of train/memory/allocator.py:
`replay`, the live peak, the smallest per-process limit the step runs in (a bisection that
reuses the runs it shares, `_Runs`), `predict_reserved` (what the predictor calls: every figure
of a prediction at once) and the cuBLAS workspaces a step holds. cudaMallocAsync, which the
model does not apply to, is answered from the live peak. No torch: replays_beside
(train/memory/predict.py) runs this in a forked process."""

from __future__ import annotations

import bisect
import itertools
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from batchfit.train.device.allocator_settings import (
    LIMIT_RESOLUTION_BYTES,
    AllocatorSettings,
    KiB,
    allocation_size,
    round_up,
)
from batchfit.train.device.cudnn_workspaces import ElasticKey
from batchfit.train.memory.allocator import AllocatorOutOfMemory, CachingAllocatorModel


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
    """replay of events _rounded gave. An allocation that gives way (ElasticKey: a cuDNN
    workspace) and finds no room is left out with its free, as PyTorch then runs the
    convolution with an engine that needs less: c10 released the cache first, as the model
    did before raising."""
    malloc, free = model.malloc_rounded, model.free
    skipped: set[object] = set()
    for key, size in events:
        if size < 0:
            if not skipped or key not in skipped:
                free(key)
            else:
                skipped.discard(key)
        elif type(key) is not ElasticKey:
            malloc(key, size)
        else:
            try:
                malloc(key, size)
            except AllocatorOutOfMemory:
                skipped.add(key)


def rigid(events: Iterable[tuple[object, int]]) -> list[tuple[object, int]]:
    """The events without those that give way under a limit (ElasticKey) and their frees:
    what a step needs at least."""
    elastic = {key for key, size in events if type(key) is ElasticKey}
    return [(key, size) for key, size in events if key not in elastic]


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
    high = round_up(high_bytes, LIMIT_RESOLUTION_BYTES) // LIMIT_RESOLUTION_BYTES
    while high - low > 1:
        middle = (low + high) // 2
        found = fits(middle * LIMIT_RESOLUTION_BYTES)
        if found is True:
            high = middle
        elif found:
            high = min(middle, round_up(found, LIMIT_RESOLUTION_BYTES) // LIMIT_RESOLUTION_BYTES)
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
        unlimited.limit_checks = checks
        malloc, free = unlimited.malloc_rounded, unlimited.free
        for i, (key, size) in enumerate(steps):
            if size < 0:
                free(key)
            else:
                unlimited.event_index = i
                malloc(key, size)
        unlimited.limit_checks = None
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
        floor = live_peak_bytes(rigid(self.steps)) - 1  # no limit below runs the step
        return smallest_fitting_limit(self.peak_under, floor, high)


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
        return _async_reserved_bytes(rigid(steps))
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
    return round_up(peak, LIMIT_RESOLUTION_BYTES)


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
        peak, least = _async_reserved_bytes(steps), _async_reserved_bytes(rigid(steps))
        under = peak if limit_bytes is None or peak <= limit_bytes else None
        if under is None and least <= limit_bytes:  # workspaces gave way (ElasticKey)
            under = limit_bytes
        return CudaReserve(peak, least, under)
    runs = _Runs(_rounded(steps, settings), settings)
    peak = under = runs.unlimited.peak_reserved_bytes
    if limit_bytes is not None:
        limited = runs.under(limit_bytes)
        under = None if limited is None else limited.peak_reserved_bytes
    least = runs.smallest_limit()
    return CudaReserve(peak, least, under)


# ------------------------------------------------------------------------------ cuBLAS


# What ATen holds for cuBLAS, by torch release (aten/src/ATen/cuda/CublasHandlePool.cpp and
# CUDABlas.cpp; the release a rule came with is the first branch cut after its merge):
# - each handle's workspace comes from the caching allocator and stays, one per (handle,
#   stream): pytorch/pytorch#83461 (1.13), unconditional again from #124250 (2.4) to 2.14;
# - its default size (parseChosenWorkspaceSize): 4096 KiB x 8 = 32 MiB on compute capability
#   9.0 only, else 4096 KiB x 2 + 16 KiB x 8 (#89027, #91564: 2.0 to 2.11); 32 MiB on majors
#   9, 10 and 12 from #175344 (merged after the 2.11 cut: 2.12); major 11 too from #189312
#   (2.14). CUBLAS_WORKSPACE_CONFIG's `:SIZE_KiB:COUNT` pairs, summed, override it in all;
# - cuBLASLt's own workspace (CUBLASLT_WORKSPACE_SIZE KiB, 1024 by default): allocated per
#   call before (none held in the 2025 traces of tests/fixtures/cuda-traces), cached per
#   (handle, stream) beside cuBLAS's in the 2.10/2.11 source unless
#   TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 (#151163; the release the cache came with is not
#   pinned: counted from 2.10); from 2.12 the cuBLAS workspace serves both unless that
#   variable is 0 (#175879, #173002);
# - from 2.15 (#194311) the workspaces stay only with TORCH_CUBLAS_WORKSPACE_CACHE=1; unset,
#   each GEMM allocates one from the caching allocator and frees it when it returns, where
#   the next GEMM finds it again: counted as one held from the first GEMM on.
# Training has two handles, the main thread's and the autograd device thread's (a handle
# per thread and device) on the one stream.
_BLACKWELL_32MIB = (2, 12)  # majors 9, 10, 12
_THOR_32MIB = (2, 14)  # and 11
_LT_CACHED = (2, 10)
_LT_SHARED = (2, 12)
_PER_GEMM = (2, 15)


def torch_release() -> tuple[int, int]:
    """The installed torch's (major, minor), read without importing it."""
    from importlib.metadata import version

    found = re.match(r"(\d+)\.(\d+)", version("torch"))
    assert found is not None
    return int(found[1]), int(found[2])


def cublas_workspaces(
    capability: tuple[int, int],
    training: bool,
    environ: Mapping[str, str] = os.environ,
    release: tuple[int, int] | None = None,
) -> tuple[int, ...]:
    """The cuBLAS (and cuBLASLt) workspaces the caching allocator holds for a step under
    torch `release` (None: the installed one) and `environ`, by the rules above: one per
    handle (two in training: the autograd device thread has its own), each
    getChosenWorkspaceSize, plus cuBLASLt's own where it is not shared."""
    release = release or torch_release()
    num_handles = 2 if training else 1
    cached = release < _PER_GEMM or _env_flag(environ, "TORCH_CUBLAS_WORKSPACE_CACHE") is True
    if not cached:
        return (_chosen_workspace_bytes(capability, environ, release),)
    workspaces = (_chosen_workspace_bytes(capability, environ, release),) * num_handles
    unified = _env_flag(environ, "TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if release >= _LT_CACHED and ((release < _LT_SHARED and unified is None) or unified is False):
        lt = int(environ.get("CUBLASLT_WORKSPACE_SIZE", "1024") or 1024) * KiB
        workspaces += (lt,) * num_handles
    return workspaces


def _env_flag(environ: Mapping[str, str], name: str) -> bool | None:
    """c10::utils::check_env: "1"/"true" True, "0"/"false" False, else unset (None)."""
    value = environ.get(name, "").strip().lower()
    return {"1": True, "true": True, "0": False, "false": False}.get(value)


def _chosen_workspace_bytes(
    capability: tuple[int, int], environ: Mapping[str, str], release: tuple[int, int]
) -> int:
    major = tuple(capability)[0]
    if release >= _THOR_32MIB:
        large = major in (9, 10, 11, 12)
    elif release >= _BLACKWELL_32MIB:
        large = major in (9, 10, 12)
    else:
        large = tuple(capability) == (9, 0)
    default = 4096 * 8 * KiB if large else (4096 * 2 + 16 * 8) * KiB
    config = environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:  # torch warns and uses the default
        return default
    return sum(int(size) * KiB * int(count) for size, count in pairs)
