"""One fit report as a value: its cells (a batch size, accumulation and precision, with the
predicted peak and whether it fits) and what the table says about them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchfit.train.params import (
    CHECKPOINTING_KEY,
)


@dataclass
class Cell:
    effective_batch_size: int  # samples per optimizer step: batch_size x accum_steps
    batch_size: int | None  # the micro-batch (searched: the row's; derived: chosen, or None)
    accum_steps: int | None  # derived: chosen, or None when not even a micro-batch of 1 fits
    peak_bytes: int | None  # None: not predicted (see reason) or, derived, nothing fits
    fits: bool | None  # None: not applicable, the device cannot run the precision
    reason: str | None = None  # why there is no prediction


@dataclass
class FitReport:
    budget_bytes: int | None
    margin: float  # the share of each peak kept free under the budget
    derived: bool
    precisions: list[str]  # every precision of the space, those the device cannot run included
    unsupported: dict[str, str]  # precision -> why the device cannot run it (not predicted)
    batch_sizes: list[int]  # rows: micro-batches (searched) or effective batches (derived)
    accum_steps: list[int | None]  # searched: every accumulation of the space; derived: [None]
    cells: dict[tuple[str, int, int | None], Cell] = field(default_factory=dict)
    seconds: float = 0.0
    # Other searched keys, held at the config's value here (e.g. data.seq_len: memory also
    # follows it; each trial is predicted with its own).
    held: dict[str, object] = field(default_factory=dict)
    checkpointing: str = "none"  # trainer.activation_checkpointing of every cell
    searched: tuple[str, ...] = ()  # the keys of the space
    # The values of the other discrete searched keys memory follows (data.seq_len=128) that
    # this report is for: fit_reports gives one report per combination.
    at: dict[str, object] = field(default_factory=dict)
    device: str = ""  # what is predicted for: "cpu", "A100-40GB (CUDA reserve, planned)"
    strategy: str = "none"  # a data-parallel layout: each cell is one rank's step
    world_size: int = 1
    limit_bytes: int = 0  # what the cells must fit: the budget, or the whole device
    budget_source: str = ""  # where the budget comes from: "90% of H100-80GB", ...
    # why the margin is what it is: "language-model LoRA steps measured within 0.71% on an
    # H200", "search.preflight_margin" (given), "" (CPU's default)
    margin_why: str = ""
    cuda: bool = False  # cells are CUDA's reserve (the caching allocator's), not live tensors
    # cuDNN convolutions' workspaces (train/memory/cudnn.py): "cap" (each call counted at the
    # cap, a bound), "measured" (on this GPU), "none" (not counted: no cap), "" (no
    # convolutions, or not CUDA); the cap
    workspaces: str = ""
    workspace_cap_bytes: int | None = None
    # cuDNN batch norms over channels-last input whose buffers are not known off the card
    norms_unknown: bool = False
    # model.dtype, the weights' dtype (float32, bfloat16, auto); None: the model has no such
    # key, its weights are float32
    model_dtype: str | None = None
    # The peaks of the same cells without activation checkpointing, when this report is a
    # checkpointing one and the report without it was predicted first (fit_reports)
    without_checkpointing: dict[tuple[str, int, int | None], int | None] = field(
        default_factory=dict
    )

    def largest(self, precision: str, accum: int | None = None) -> int | None:
        """The largest row that fits with every smaller row of its column fitting too: what
        a user can count on (a row that cannot train, BatchNorm on one sample, is passed)."""
        largest = None
        for row in self.batch_sizes:
            cell = self.cells[precision, row, accum]
            if cell.reason is not None and cell.peak_bytes is None:
                continue
            if not cell.fits:
                break
            largest = row
        return largest

    def placement_only(self, precision: str, accum: int | None) -> tuple[int, int] | None:
        """(first row that fits above a smaller one that does not, that smaller row), or None:
        the caching allocator placed the larger step's blocks better (on a CPU: its peak is
        not monotonic in the batch)."""
        failed = None
        for row in self.batch_sizes:
            cell = self.cells[precision, row, accum]
            if cell.fits is False and cell.reason is None and failed is None:
                failed = row
            elif cell.fits and failed is not None:
                return row, failed
        return None

    def marked(self, precision: str, row: int, accum: int | None) -> str:
        """The marks of a cell: † it fits above a smaller row that does not; ‡ it needs more
        with activation checkpointing than without."""
        marks = ""
        found = self.placement_only(precision, accum)
        cell = self.cells[precision, row, accum]
        if found is not None and cell.fits and row >= found[0]:
            marks += "†"
        baseline = self.without_checkpointing.get((precision, row, accum))
        if baseline is not None and cell.peak_bytes is not None and cell.peak_bytes > baseline:
            marks += "‡"
        return marks

    def bf16_over_fp32(self) -> list[tuple[int, int | None]]:
        """(row, accumulation) where bf16 is predicted to need more than fp32."""
        if self.derived or not {"fp32", "bf16"} <= set(self.precisions):
            return []
        over = []
        for accum in self.accum_steps:
            for row in self.batch_sizes:
                fp32, bf16 = (self.cells[p, row, accum].peak_bytes for p in ("fp32", "bf16"))
                if fp32 is not None and bf16 is not None and bf16 > fp32:
                    over.append((row, accum))
        return over

    def layout_words(self) -> str:
        """The layout this report is for: activation_checkpointing=blocks, data.seq_len=256."""
        words = []
        if self.checkpointing != "none" or CHECKPOINTING_KEY in self.searched:
            words.append(f"activation_checkpointing={self.checkpointing}")
        if self.strategy != "none":
            words.append(f"{self.strategy} on {self.world_size} devices")
        words += [f"{key}={value}" for key, value in self.at.items()]
        return ", ".join(words) or "as configured"

    def fits_anywhere(self) -> bool:
        return any(cell.fits for cell in self.cells.values())

    def accum_groups(self) -> list[list[int | None]]:
        """The accumulations, those whose cells are the same at every batch size and precision
        together (a prediction runs a step's first two micro-batches only: 2 and 4 usually
        peak alike, 1 lower)."""
        groups: dict[tuple, list[int | None]] = {}
        for accum in self.accum_steps:
            outcome = tuple(
                (c.peak_bytes, c.fits, c.reason)
                for c in (
                    self.cells[p, b, accum] for p in self.precisions for b in self.batch_sizes
                )
            )
            groups.setdefault(outcome, []).append(accum)
        return list(groups.values())

    def rows(self) -> dict[str, list]:
        """Column-wise, for mlflow's log_table: one row per (precision, row, accumulation)."""
        columns: dict[str, list] = {
            "precision": [], "batch_size": [], "accum_steps": [], "effective_batch_size": [],
            "predicted_bytes": [], "fits": [], "reason": [], "activation_checkpointing": [],
            "strategy": [], "world_size": [],
        }  # fmt: skip
        for key in self.at:
            columns[key] = []
        for (precision, _, _), cell in self.cells.items():
            for key, value in self.at.items():
                columns[key].append(value)
            columns["precision"].append(precision)
            columns["activation_checkpointing"].append(self.checkpointing)
            columns["strategy"].append(self.strategy)
            columns["world_size"].append(self.world_size)
            columns["batch_size"].append(cell.batch_size)
            columns["accum_steps"].append(cell.accum_steps)
            columns["effective_batch_size"].append(cell.effective_batch_size)
            columns["predicted_bytes"].append(cell.peak_bytes)
            columns["fits"].append(cell.fits)
            columns["reason"].append(cell.reason)
        return columns
