"""The fit report: which batch sizes fit the memory budget, per precision, without training.

    python -m search.fit +experiment=resnet data=digits

For every precision and batch size of the search space, with the base config's model and
optimizer (other searched keys at their configured values), the predicted peak memory of a
training step (train/predict.py: the step computed on fake tensors) and the largest batch
size that fits the budget with search.preflight_margin to spare. With
search.accumulation=derived, the rows are the searched effective batch sizes and each cell
gives the micro-batch x accumulation a trial would train with. A study logs the same table to
its parent MLflow run (`fit_report.json`, `fit_report.txt`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from rich.console import Console
from rich.table import Table

from search.config import SearchConfig
from search.space import SearchSpace
from train.config import ConfigError
from train.memory import format_bytes
from train.predict import PredictionUnsupported, fits_budget, largest_fitting_batch
from train.run import RunSpec, build_data, memory_predictor

BATCH_KEY = "trainer.batch_size"
EFFECTIVE_KEY = "trainer.effective_batch_size"
ACCUM_KEY = "trainer.accum_steps"
PRECISION_KEY = "trainer.precision"


@dataclass
class Cell:
    peak_bytes: int | None  # None: not even a micro-batch of 1 fits (derived) or no prediction
    fits: bool
    batch_size: int  # the micro-batch (derived: chosen; searched: the row's)
    accum_steps: int
    error: str | None = None


@dataclass
class FitReport:
    budget_bytes: int | None
    margin: float
    derived: bool
    accum_steps: int  # searched mode: the largest searched accumulation, the worst case
    precisions: list[str]
    batch_sizes: list[int]  # rows: micro-batches (searched) or effective batches (derived)
    cells: dict[tuple[str, int], Cell] = field(default_factory=dict)
    seconds: float = 0.0

    def largest(self, precision: str) -> int | None:
        fitting = [b for b in self.batch_sizes if self.cells[precision, b].fits]
        return max(fitting, default=None)

    def rows(self) -> dict[str, list]:
        """Column-wise, for mlflow's log_table."""
        columns: dict[str, list] = {
            "precision": [], "batch_size": [], "accum_steps": [], "effective_batch_size": [],
            "predicted_bytes": [], "fits": [],
        }  # fmt: skip
        for (precision, row), cell in self.cells.items():
            columns["precision"].append(precision)
            columns["batch_size"].append(cell.batch_size)
            columns["accum_steps"].append(cell.accum_steps)
            columns["effective_batch_size"].append(row if self.derived else None)
            columns["predicted_bytes"].append(cell.peak_bytes)
            columns["fits"].append(cell.fits)
        return columns


def _values(dist: BaseDistribution | None, fixed: str | None, default: object) -> list:
    """The values a space key takes: its choices, the powers of two in an int range (plus
    its ends), its fixed value, or the config's."""
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    if isinstance(dist, IntDistribution):
        step = dist.step or 1
        powers = [
            2**k
            for k in range(32)
            if dist.low <= 2**k <= dist.high and (2**k - dist.low) % step == 0
        ]
        return sorted({dist.low, *powers, dist.high})
    if fixed is not None:
        return [type(default)(fixed)] if default is not None else [fixed]
    return [default]


def fit_report(
    cfg: DictConfig, space: SearchSpace, spec: RunSpec, settings: SearchConfig
) -> FitReport:
    """Predict every (precision, batch size) of the space; PredictionUnsupported when the
    model cannot run on fake tensors."""
    started = time.perf_counter()
    derived = settings.accumulation == "derived"
    trainer = spec.trainer
    dists, fixed = space.distributions, space.fixed
    precisions = [
        str(p)
        for p in _values(dists.get(PRECISION_KEY), fixed.get(PRECISION_KEY), trainer.precision)
    ]
    row_key = EFFECTIVE_KEY if derived else BATCH_KEY
    rows = sorted(
        int(b)
        for b in _values(
            dists.get(row_key),
            fixed.get(row_key),
            trainer.effective_batch_size if derived else trainer.batch_size,
        )
    )
    accum = max(
        int(a) for a in _values(dists.get(ACCUM_KEY), fixed.get(ACCUM_KEY), trainer.accum_steps)
    )
    report = FitReport(
        spec.budget_bytes, settings.preflight_margin, derived, accum, precisions, rows
    )
    predictor = memory_predictor(cfg, spec)
    num_train = len(build_data(cfg).train_y)
    for precision in precisions:
        for row in rows:
            if derived:
                geometry = dataclasses.replace(
                    trainer,
                    batch_size=row,
                    accum_steps=1,
                    effective_batch_size=None,
                    precision=precision,
                )
                found = largest_fitting_batch(
                    predictor, geometry, num_train, spec.limit_bytes, settings.preflight_margin
                )
                if found is None:
                    report.cells[precision, row] = Cell(None, False, 0, 0)
                else:
                    b, prediction = found
                    report.cells[precision, row] = Cell(prediction.peak_bytes, True, b, row // b)
                continue
            geometry = dataclasses.replace(
                trainer,
                batch_size=row,
                accum_steps=accum,
                effective_batch_size=None,
                precision=precision,
            )
            try:
                peak = predictor.predict(geometry, num_train).peak_bytes
            except PredictionUnsupported as error:
                if row != 1:  # the model does not run on fake tensors: no report
                    raise
                # BatchNorm over a 1x1 feature map cannot train on a single sample
                report.cells[precision, row] = Cell(None, False, row, accum, str(error))
                continue
            fits = fits_budget(peak, spec.limit_bytes, settings.preflight_margin)
            report.cells[precision, row] = Cell(peak, fits, row, accum)
    report.seconds = time.perf_counter() - started
    return report


def render(report: FitReport) -> Table:
    budget = format_bytes(report.budget_bytes) if report.budget_bytes else "the whole device"
    what = (
        "effective batch: micro-batch x accumulation, peak"
        if report.derived
        else (f"batch size (accum_steps={report.accum_steps}): predicted peak")
    )
    table = Table(
        title=f"Fit report: {what}; budget {budget}, margin {report.margin:.0%}",
        caption=f"predicted in {report.seconds:.1f} s, nothing trained",
    )
    table.add_column("effective batch" if report.derived else "batch size", justify="right")
    for precision in report.precisions:
        table.add_column(precision, justify="right")
    for row in report.batch_sizes:
        cells = []
        for precision in report.precisions:
            cell = report.cells[precision, row]
            if cell.peak_bytes is None:
                cells.append(
                    "[red]does not fit[/red]" if cell.error is None else "[dim]cannot train[/dim]"
                )
                continue
            text = format_bytes(cell.peak_bytes)
            if report.derived:
                text = f"{cell.batch_size} x {cell.accum_steps}, {text}"
            cells.append(f"[green]{text}[/green]" if cell.fits else f"[red]{text} (OOM)[/red]")
        table.add_row(str(row), *cells)
    table.add_section()
    table.add_row(
        "largest that fits",
        *(f"[bold]{report.largest(p) or '-'}[/bold]" for p in report.precisions),
    )
    return table


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from search.validate import validate  # the study's own checks, storage left alone

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    hydra_cfg = HydraConfig.get()
    name = cfg.search.study_name or "fit-report"  # checked, not used: nothing is recorded
    base = list(hydra_cfg.overrides.task)

    def compose(trial_overrides: list[str]) -> DictConfig:
        return hydra.compose(config_name="config", overrides=base + trial_overrides)

    try:
        checked = validate(cfg, name, compose, open_store=False)
        report = fit_report(cfg, checked.space, checked.spec, checked.settings)
    except ConfigError as error:
        Console(stderr=True).print(f"[bold red]Configuration error[/bold red]\n{error}")
        sys.exit(2)
    except PredictionUnsupported as error:
        Console(stderr=True).print(
            f"[bold red]Memory cannot be predicted for this model[/bold red]: it does not run "
            f"on fake tensors ({error}). A study still runs: its trials measure their memory."
        )
        sys.exit(3)
    for note in checked.notes:
        console.print(f"[yellow]note[/yellow] {note}", soft_wrap=True)
    console.print(render(report))


if __name__ == "__main__":
    main()
