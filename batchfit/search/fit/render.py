"""A fit report as the user reads it: the table, its summary lines and the notes under it
(workspaces, placement, checkpointing, bf16).
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from batchfit.search.fit.report import FitReport
from batchfit.train.device.sizes import format_bytes
from batchfit.train.memory.preflight import Margin
from batchfit.train.params import (
    CHECKPOINTING_KEY,
)


def summary_lines(reports: list[FitReport]) -> list[str]:
    """A study's few lines in place of the tables: per layout, the largest batch that fits
    per precision (the boundary), at each accumulation where they differ."""
    first = reports[0]
    accums = first.accum_steps
    at = (
        "" if first.derived or len(accums) == 1 else f" at accum_steps {'/'.join(map(str, accums))}"
    )
    budget = f"{format_bytes(first.limit_bytes)} ({first.budget_source})"
    if first.strategy != "none":
        budget += " per rank"
    rows = "effective batch" if first.derived else "batch size"
    seconds = sum(r.seconds for r in reports)
    margin = Margin(first.margin, first.margin_why).words()
    lines = [
        f"Fit report for {first.device}: the largest {rows} predicted to fit {budget}, margin "
        f"{margin}, per precision{at} (predicted in {seconds:.1f} s, nothing trained):"
    ]
    boundary = {}
    for report in reports:
        largest = []
        for precision in report.precisions:
            if precision not in report.unsupported:
                found = [str(report.largest(precision, a) or "-") for a in report.accum_steps]
                each = found[0] if len(set(found)) == 1 else "/".join(found)
                largest.append(f"{precision} {each}")
        boundary[report.layout_words()] = ", ".join(largest)
    if len(boundary) > 1 and len(set(boundary.values())) == 1:  # one line says them all
        keys = ", ".join(dict.fromkeys(w.split("=")[0] for k in boundary for w in k.split(", ")))
        boundary = {f"each of the {len(boundary)} layouts ({keys})": next(iter(boundary.values()))}
    lines += [f"  {layout}: {largest}" for layout, largest in boundary.items()]
    lines += [f"  {p}: n/a ({reason}; trials skip it)" for p, reason in first.unsupported.items()]
    return lines


def render(report: FitReport) -> Table:
    budget = f"{format_bytes(report.limit_bytes)} ({report.budget_source})"
    what = (
        "effective batch: micro-batch x accumulation, peak"
        if report.derived
        else "predicted peak per batch size x accum_steps"
    )
    said = [f"n/a: {reason}; trials skip it" for reason in report.unsupported.values()]
    if report.held:
        held = ", ".join(f"{key}={value}" for key, value in report.held.items())
        said.append(f"at {held}, as configured; trials predict their own values")
    lever = (
        f"; activation_checkpointing={report.checkpointing}"
        if report.checkpointing != "none" or CHECKPOINTING_KEY in report.searched
        else ""
    )
    lever += "".join(f"; {key}={value}" for key, value in report.at.items())
    device = report.device
    if report.strategy != "none":
        device = f"one rank of {report.strategy} on {report.world_size} x {device}"
        budget += " per rank"
    margin = Margin(report.margin, report.margin_why).words()
    table = Table(
        title=f"Fit report for {device}: {what}; budget {budget}, margin {margin}{lever}",
        caption="\n".join([f"predicted in {report.seconds:.1f} s, nothing trained", *said]),
    )
    table.add_column("effective batch" if report.derived else "batch size", justify="right")
    for precision in report.precisions:
        table.add_column(precision, justify="right")
    for group in report.accum_groups():
        accum = group[0]
        if not report.derived:
            label = f"accum_steps {', '.join(map(str, group))}"
            if len(group) > 1:
                label += ": same peak"
            table.add_row(Text(label, style="bold", justify="left"))
        for row in report.batch_sizes:
            table.add_row(str(row), *(_cell_text(report, p, row, accum) for p in report.precisions))
        table.add_section()
        largest = [
            "[dim]n/a[/dim]"
            if p in report.unsupported
            else f"[bold]{report.largest(p, accum) or '-'}[/bold]"
            for p in report.precisions
        ]
        table.add_row("largest that fits", *largest, end_section=True)
    return table


def _workspace_words(report: FitReport) -> list[str]:
    """What the cells count for cuDNN convolutions' workspaces (train/memory/cudnn.py): what
    fits never counts one (PyTorch runs an engine that needs less: ElasticKey); with room,
    each call's is measured on this GPU or counted at the cap."""
    fits = "what fits counts no workspace (where one does not fit, PyTorch runs a cuDNN engine "
    fits += "that needs less)"
    if report.workspaces == "measured":
        return [f"cuDNN convolutions: {fits}; with room, each call's workspace as measured "
                "on this GPU"]  # fmt: skip
    if report.workspaces == "none":
        return [
            f"cuDNN convolutions: {fits}; with room, none counted (no cap: "
            "cudnn_workspace_mib=null), so the reserve may be under-predicted"
        ]
    if report.workspaces != "cap" or report.workspace_cap_bytes is None:
        return []
    cap = format_bytes(report.workspace_cap_bytes)
    return [
        f"cuDNN convolutions: {fits}; with room, each call's workspace counted at the {cap} "
        f"cap batchfit sets for cuDNN (cudnn_workspace_mib), a bound where cuDNN honours it "
        f"(docs/gpu-planning.md)"
    ]


def notes(report: FitReport) -> list[str]:
    """The lines printed under a report's table: why cells are marked † or ‡, why bf16
    needs more than fp32 where it does, and what cuDNN convolutions' workspaces are counted
    at (outside the table, whose width would wrap them)."""
    lines = (_placement_note(report), _checkpointing_note(report), _bf16_note(report))
    norms = [NORMS_UNKNOWN] if report.norms_unknown else []
    return [line for line in lines if line] + _workspace_words(report) + norms


NORMS_UNKNOWN = (
    "cuDNN batch norms over channels-last input (its persistent kernel): their workspaces "
    "and reserve are not known off the card and are not counted; on the GPU itself they are "
    "measured"
)


def _where(report: FitReport, precision: str, accum: int | None) -> str:
    return precision if report.derived else f"{precision}, accum_steps {accum}"


def _placement_note(report: FitReport) -> str | None:
    """Why a cell is marked †, with the first such column's smaller batch that does not fit."""
    for precision in report.precisions:
        for accum in report.accum_steps:
            found = report.placement_only(precision, accum)
            if found is None:
                continue
            row, smaller = found
            peak = report.cells[precision, smaller, accum].peak_bytes
            needs = f"needs {format_bytes(peak)}" if peak is not None else "does not fit"
            example = f"{_where(report, precision, accum)}: {row} fits, {smaller} {needs}"
            cause = (
                "fits only through the caching allocator's block placement"
                if report.cuda
                else "fits, its peak lower than a smaller batch's"
            )
            return (
                f"†: {cause}; a smaller batch does not fit ({example}), so 'largest that "
                "fits' stops below it"
            )
    return None


def _checkpointing_note(report: FitReport) -> str | None:
    """Why a cell is marked ‡, with the first one and its peak without checkpointing."""
    for (precision, row, accum), cell in report.cells.items():
        if "‡" in report.marked(precision, row, accum):
            without = report.without_checkpointing[precision, row, accum]
            return (
                f"‡: needs more with activation checkpointing than without "
                f"({_where(report, precision, accum)}, {row}: {format_bytes(cell.peak_bytes)} "
                f"against {format_bytes(without)}): at this size recomputing a block in the "
                "backward pass holds more than checkpointing saves; train it without"
            )
    return None


def _bf16_note(report: FitReport) -> str | None:
    """Why bf16 needs more than fp32, where it does over float32 weights."""
    over = report.bf16_over_fp32()
    if not over or report.model_dtype not in (None, "float32"):
        return None
    rows: dict[int | None, list[int]] = {}
    for row, accum in over:
        rows.setdefault(accum, []).append(row)
    by_rows: dict[tuple[int, ...], list[int | None]] = {}
    for accum, each in rows.items():
        by_rows.setdefault(tuple(each), []).append(accum)
    where = "; ".join(
        f"batch {', '.join(map(str, each))} (accum_steps {', '.join(map(str, accums))})"
        for each, accums in by_rows.items()
    )
    fix = (
        "load the base in bfloat16 (model.dtype=bfloat16) to halve the weights"
        if report.model_dtype == "float32"
        else "this model has no model.dtype: bf16 pays off only where the activations it "
        "halves outweigh the copies"
    )
    return (
        f"bf16 needs more than fp32 at {where}: autocast keeps the fp32 weights and adds bf16 "
        "copies of the weights each layer uses (kept for the backward pass), so bf16 autocast "
        f"over fp32 weights needs more; {fix}"
    )


def _cell_text(report: FitReport, precision: str, row: int, accum: int | None) -> str:
    cell = report.cells[precision, row, accum]
    if cell.fits is None:
        return "[dim]n/a[/dim]"
    if cell.peak_bytes is None:
        return "[red]does not fit[/red]" if cell.reason is None else "[dim]cannot train[/dim]"
    text = format_bytes(cell.peak_bytes) + report.marked(precision, row, accum)
    if report.derived:
        text = f"{cell.batch_size} x {cell.accum_steps}, {text}"
    return f"[green]{text}[/green]" if cell.fits else f"[red]{text} (OOM)[/red]"
