"""Peak memory measured and the budget enforced, and memory released after an OOM (the budget's
bytes are parsed by train/device/sizes.py).

On CUDA the budget is real: `set_per_process_memory_fraction` makes the caching allocator raise
`torch.OutOfMemoryError` past it, and the allocator's peak statistics are the measurement.
On CPU the budget is accounted: step 0 and the first full-size step with optimizer state run
under `TensorMemoryTracker` (train/step.py `memory_steps`), which sees every tensor storage
created or freed, and a peak above the budget is the same OOM.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _push_mode
from torch.utils._pytree import tree_iter
from torch.utils.weak import WeakIdKeyDictionary

from batchfit.train.device.cudnn_workspaces import ElasticKey
from batchfit.train.device.sizes import device_total_bytes, format_bytes
from batchfit.train.language.quantize import composites as bitsandbytes_composites


class OutOfMemory(Exception):
    """A run needed more memory than its budget. Carries plain numbers, never tensors."""

    def __init__(
        self,
        message: str,
        peak_bytes: int | None,
        budget_bytes: int | None,
        rank: int | None = None,
    ):
        super().__init__(message)
        self.peak_bytes = peak_bytes
        self.budget_bytes = budget_bytes
        self.rank = rank  # of a data-parallel run: the rank that ran out

    def __reduce__(self):  # noqa: ANN204 - pickled from a rank to the launching process
        return type(self), (str(self), self.peak_bytes, self.budget_bytes, self.rank)


class TensorMemoryTracker(TorchDispatchMode):
    """Exact live and peak bytes of tensor storages while active.

    Every op's outputs are looked at: a storage not seen before is counted until Python
    frees it (a weakref callback on the storage). Storages that exist before the tracker
    starts count only if passed to `register` (parameters, gradients, optimizer state);
    any other pre-existing storage met as an op input (host-side dataset, say) counts as
    zero, so views of it are not mistaken for new memory.

    An op that is one op to a dispatch mode but allocates temporaries inside its kernel
    (bitsandbytes' 4-bit matmul dequantizes its weight: train/language/quantize.py) runs as
    the composition its kernel runs, each part tracked, so its temporaries count.
    """

    def __init__(
        self,
        device: torch.device | None = None,
        record: bool = False,
        composites: Mapping[Any, Callable[..., Any]] | None = None,
    ) -> None:
        super().__init__()
        self.device = device  # None: every storage; else storages on other devices count 0
        self._cells: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: list[weakref.ref | None] = []  # by storage number
        self.live_bytes = 0
        self.peak_bytes = 0
        # With record: (storage number, bytes) per allocation and (number, -1) per free, in
        # order, for a model of the CUDA caching allocator (train/memory/predict.py).
        self.events: list[tuple[int, int]] | None = [] if record else None
        # Ops run as their composition: bitsandbytes' (when imported) and the caller's (a CUDA
        # target's cuDNN convolutions with their workspaces: train/memory/cudnn.py). A
        # composition may call its own op: within it, that op runs as itself.
        self._composites = {**bitsandbytes_composites(), **(composites or {})}
        self._composing: set[Any] = set()

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            self._track(tensor, count=True)

    def _track(self, tensor: torch.Tensor, count: bool) -> None:
        # A DTensor (FSDP2's sharded parameters, gradients and optimizer state) reports the
        # storage of its whole logical shape; this rank holds its local shard.
        tensor = getattr(tensor, "_local_tensor", tensor)
        storage = tensor.untyped_storage()
        cell = self._cells.get(storage)  # [bytes counted now, counted at all, number]
        if cell is None:
            if self.device is not None and tensor.device != self.device:
                count = False
            cell = [storage.nbytes() if count else 0, count, len(self._refs)]
            self._cells[storage] = cell
            self._refs.append(weakref.ref(storage, self._freed_callback(cell)))
            self._add(cell[0])
            self._record(cell)
        elif cell[1] and cell[0] != storage.nbytes():  # resized in place
            # resize_ allocates the new buffer, copies, then frees the old one: both are
            # live for a moment. The new buffer is a new allocation, with a number of its own.
            old_bytes, old_number = cell[0], cell[2]
            cell[0], cell[2] = storage.nbytes(), len(self._refs)
            self._refs.append(None)  # the number is taken; the storage's weakref is kept
            self._add(cell[0])
            self._record(cell)
            self.live_bytes -= old_bytes
            if self.events is not None and old_bytes > 0:
                self.events.append((old_number, -1))

    def elastic(self, tensor: torch.Tensor) -> None:
        """Marks the allocation just recorded for `tensor` as one that gives way under a
        limit (a cuDNN workspace: ElasticKey); its free keeps the plain number."""
        cell = self._cells.get(tensor.untyped_storage())
        if self.events is None or cell is None or not cell[0]:
            return
        for i in range(len(self.events) - 1, -1, -1):
            if self.events[i] == (cell[2], cell[0]):
                self.events[i] = (ElasticKey(cell[2]), cell[0])
                return

    def _record(self, cell: list) -> None:
        if self.events is not None and cell[0] > 0:
            self.events.append((cell[2], cell[0]))

    def _freed_callback(self, cell: list):  # noqa: ANN202 - weakref callback
        def freed(_ref: weakref.ref) -> None:
            self.live_bytes -= cell[0]
            if self.events is not None and cell[0] > 0:
                self.events.append((cell[2], -1))

        return freed

    def _resized(self, storage: Any, old_bytes: int) -> None:
        """After `storage.resize_`: FSDP2 frees its gathered parameters by resizing their
        storage to 0 and allocates them again by resizing it back (not a tensor op, so
        not dispatched). Down to 0 is a free; up from 0 an allocation, with a number of
        its own."""
        new_bytes = storage.nbytes()
        cell = self._cells.get(storage)
        if new_bytes == old_bytes or (cell is not None and cell[0] == new_bytes):
            return
        if cell is None:
            cell = [0, True, len(self._refs)]
            self._cells[storage] = cell
            self._refs.append(weakref.ref(storage, self._freed_callback(cell)))
        if cell[0] > 0:  # a counted allocation ends
            self.live_bytes -= cell[0]
            if self.events is not None:
                self.events.append((cell[2], -1))
        cell[0], cell[1] = new_bytes, True
        if new_bytes > 0:
            cell[2] = len(self._refs)
            self._refs.append(None)  # the number is taken; the storage's weakref is kept
            self._add(new_bytes)
            self._record(cell)

    def __enter__(self):  # noqa: ANN204
        tracker, resize = self, torch.UntypedStorage.resize_
        self._resize = resize

        def tracked_resize(storage, size):  # noqa: ANN001, ANN202
            old_bytes = storage.nbytes()
            result = resize(storage, size)
            tracker._resized(storage, old_bytes)
            return result

        torch.UntypedStorage.resize_ = tracked_resize
        return super().__enter__()

    def __exit__(self, *args):  # noqa: ANN002, ANN204
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        for value in tree_iter((args, kwargs)):
            if isinstance(value, torch.Tensor):
                local = getattr(value, "_local_tensor", value)
                if local.untyped_storage() not in self._cells:
                    self._track(local, count=False)
        out = NotImplemented
        composite = self._composites.get(func)
        if composite is not None and func not in self._composing:
            _push_mode(self)  # the mode is off within its own dispatch: its parts are seen
            self._composing.add(func)
            try:
                out = composite(*args, **kwargs)
            finally:
                self._composing.discard(func)
                _pop_mode()
        if out is NotImplemented:
            out = func(*args, **kwargs)
        for value in tree_iter(out):
            if isinstance(value, torch.Tensor):
                self._track(value, count=True)
        return out


@dataclass(frozen=True)
class MemoryStats:
    peak_bytes: int
    reserved_bytes: int | None  # CUDA caching allocator only


class MemoryMeter:
    """Peak memory of one run on its device, under an optional budget."""

    def __init__(self, device: torch.device, budget_bytes: int | None):
        self.device = device
        self.budget_bytes = budget_bytes
        self._cpu_peak = 0

    def start(self) -> None:
        """Reset statistics and apply the budget; call at the start of each run."""
        release_memory(self.device)
        if self.device.type == "cuda":
            # set_per_process_memory_fraction needs an index: torch.device("cuda") has none
            index = (
                self.device.index if self.device.index is not None else torch.cuda.current_device()
            )
            total = device_total_bytes(self.device)
            fraction = 1.0 if self.budget_bytes is None else min(1.0, self.budget_bytes / total)
            torch.cuda.set_per_process_memory_fraction(fraction, index)
            torch.cuda.reset_peak_memory_stats(index)
        self._cpu_peak = 0

    @property
    def needs_tracker(self) -> bool:
        return self.device.type != "cuda"

    def record_tracked_peak(self, tracker: TensorMemoryTracker, ranks: Any = None) -> None:
        """Take the peak of a tracked step and raise OutOfMemory if it exceeds the budget;
        of a data-parallel run (train/parallel/ranks.py), with what its strategy holds beside, on
        any rank."""
        if ranks is not None:
            peak = tracker.peak_bytes + ranks.state_bytes()
            ranks.agree_memory(peak, self.budget_bytes)  # over on any rank: OOM on all
            self._cpu_peak = max(self._cpu_peak, peak)  # this rank's own
            return
        self._cpu_peak = max(self._cpu_peak, tracker.peak_bytes)
        if self.budget_bytes is not None and tracker.peak_bytes > self.budget_bytes:
            raise OutOfMemory(
                f"one optimizer step needs {format_bytes(tracker.peak_bytes)}, over the budget "
                f"of {format_bytes(self.budget_bytes)}",
                peak_bytes=tracker.peak_bytes,
                budget_bytes=self.budget_bytes,
            )

    def stats(self) -> MemoryStats:
        if self.device.type == "cuda":
            return MemoryStats(
                peak_bytes=torch.cuda.max_memory_allocated(self.device),
                reserved_bytes=torch.cuda.max_memory_reserved(self.device),
            )
        return MemoryStats(peak_bytes=self._cpu_peak, reserved_bytes=None)


def is_oom_error(error: BaseException) -> bool:
    """True for a device out-of-memory error (CUDA's, or the host allocator's)."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def release_memory(device: torch.device) -> None:
    """Free what a finished or failed run left: reference cycles first, then cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
