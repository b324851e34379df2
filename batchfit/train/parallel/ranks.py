"""One rank of a data-parallel run, as the training loop sees it: the collectives its steps,
memory check and validations agree through (train/launch/distributed.py launches the ranks).

Every rank runs the same steps, micro-batches and validations, so each collective meets:
- before a step, the units of the whole step are summed (the loss is divided by them, so a
  short last step gives the one-device gradient) with a stop flag that rank 0 raises when
  the search's side of the trial asked it to stop;
- the memory check gathers every rank's peak: over the budget on any rank is an OOM of
  the run, raised on every rank and naming the first one over;
- logged losses and validation sums are summed over the ranks (torchmetrics syncs its
  metric states itself in `compute`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from batchfit.train.device.sizes import format_bytes
from batchfit.train.measure.memory import OutOfMemory

CONTINUE, END, STOP = 0, 1, 2  # what rank 0 tells the others after a hook


class Stopped(Exception):
    """The search's side of the trial stopped it (its time budget, the pruner, a signal):
    every rank ends here, and the reason is the caller's."""


@dataclass
class Ranks:
    rank: int
    world: int
    device: torch.device
    # Rank 0 only: a stop the search side asked for, polled at each step
    # (train/launch/distributed.py)
    stop_requested: Any = None
    wrapper: nn.Module | None = field(default=None, repr=False)  # the DDP module

    def _tensor(self, values: list[float | int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def step_units(self, units: int) -> int:
        """The units of the whole step; raises Stopped on every rank when rank 0 asks."""
        stop = int(self.rank == 0 and self.stop_requested is not None and self.stop_requested())
        both = self._tensor([units, stop], torch.int64)
        dist.all_reduce(both)
        total, stopped = both.tolist()  # the step's one host sync for it
        if stopped:
            raise Stopped
        return total

    def decide(self, code: int) -> int:
        """Rank 0's `code` (CONTINUE, END, STOP) on every rank."""
        value = self._tensor([code if self.rank == 0 else 0], torch.int64)
        dist.broadcast(value, 0)
        return int(value.item())

    def sum(self, values: list[float]) -> list[float]:
        tensor = self._tensor(values, torch.float64)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values`, in rank order."""
        mine = self._tensor(values, torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [t.tolist() for t in out]

    def micro_batch(self, last: bool) -> AbstractContextManager:
        """DDP reduces gradients on the step's last micro-batch only (no_sync before it);
        FSDP2 reduce-scatters each micro-batch's gradients into the shards."""
        if self.wrapper is not None and not last:
            return self.wrapper.no_sync()
        return nullcontext()

    def state_bytes(self) -> int:
        """Device memory the strategy holds outside the tensors the loop sees: DDP's
        gradient buckets (allocated by its C++ reducer), as DDP reports them."""
        if self.wrapper is None:
            return 0
        data = self.wrapper._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
        return sum(int(size) for size in str(sizes).split(",") if size.strip())

    def agree_memory(self, peak_bytes: int, budget_bytes: int | None) -> None:
        """OutOfMemory on every rank, naming the first rank over the budget, when any is;
        each rank keeps its own peak as its figure."""
        peaks = [p for (p,) in self.gather([peak_bytes])]
        over = [r for r, p in enumerate(peaks) if budget_bytes is not None and p > budget_bytes]
        if over:
            r = over[0]
            raise OutOfMemory(
                f"rank {r} of {self.world}: one optimizer step needs "
                f"{format_bytes(peaks[r])}, over the budget of {format_bytes(budget_bytes)} "
                "per rank",
                peak_bytes=peaks[r],
                budget_bytes=budget_bytes,
                rank=r,
            )
