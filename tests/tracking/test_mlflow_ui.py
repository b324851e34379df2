"""tracking/mlflow_ui.py: batchfit's saved view of an experiment, against what MLflow's UI
(its bundle, installed with mlflow) reads from a shared view. tests/test_browser.py opens it
in a browser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlflow

from batchfit.tracking.mlflow_ui import (
    RECOMMENDED_COLUMN,
    RUN_NAME_COLUMN,
    VIEW_TAG,
    experiment_tags,
    view_charts,
    view_state,
)

MLFLOW_JS = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"


def _js_list(*start: str) -> list[str]:
    """The JavaScript array of strings in MLflow's UI bundle that starts with `start`."""
    head = ",".join(f'"{name}"' for name in start)
    for bundle in sorted(MLFLOW_JS.glob("*.js")):
        found = re.search(rf'\[({head}(?:,"\w+")*)\]', bundle.read_text())
        if found:
            return json.loads(f"[{found.group(1)}]")
    raise AssertionError(f"no list starting with {head} in {MLFLOW_JS}")


def test_the_view_sets_only_what_mlflows_ui_reads_from_a_shared_view() -> None:
    """MLflow 3.17's UI (its bundle, read here: a new version may change it) takes a shared
    view's search facets and its UI state, less runsExpanded, runsPinned, runsHidden,
    runsVisibilityMap and autoRefreshEnabled. So the view cannot open the parent run (its
    sort lists the trials as rows of their own instead, tests/test_browser.py)."""
    facets = _js_list("searchFilter", "orderByKey")
    ui_state = _js_list("selectedColumns", "columnOrder")
    dropped = _js_list("runsExpanded", "runsPinned")
    assert {"orderByKey", "orderByAsc"} <= set(facets)
    assert "runsExpanded" in dropped and "runsHiddenMode" not in dropped
    state = view_state(["val/acc", "throughput/samples_per_sec"])
    assert set(state) <= set(facets) | (set(ui_state) - set(dropped)), set(state)


def test_the_view_shows_the_objectives_first_and_memory_in_mib() -> None:
    state = view_state(["val/loss", "throughput/tokens_per_sec", "memory/peak_bytes"])
    assert state["selectedColumns"][:5] == [
        RECOMMENDED_COLUMN,
        "metrics.`val/loss`",
        "metrics.`throughput/tokens_per_sec`",
        "metrics.`memory/peak_mib`",  # the objective, shown in MiB: bytes are 9 digits
        "metrics.`throughput/samples_per_sec`",
    ]
    assert not [c for c in state["selectedColumns"] if c.endswith("_bytes`")]
    assert state["columnOrder"] == [RUN_NAME_COLUMN, *state["selectedColumns"]]
    assert set(state["columnWidths"]) == set(state["columnOrder"])
    # The recommended trial's run first (its mark sorts above none, and the parent's number).
    assert (state["orderByKey"], state["orderByAsc"]) == (RECOMMENDED_COLUMN, False)
    assert state["runsHiddenMode"] == "SHOW_ALL"  # MLflow's default: the first 10 runs


def test_the_chart_view_starts_with_the_objectives_then_their_curves() -> None:
    state = view_state(["val/acc", "throughput/samples_per_sec"])
    sections = [(s["name"], s["display"]) for s in state["compareRunSections"]]
    assert sections == [
        ("Objectives", True), ("val", True), ("throughput", True), ("memory", True),
        ("time", True), ("train", True),
        ("trials", False), ("best/val", False), ("best/throughput", False),  # the parent's
    ]  # fmt: skip
    assert state["isAccordionReordered"]  # else MLflow sorts the sections by name
    by_section = {s["uuid"]: s["name"] for s in state["compareRunSections"]}
    charts = [
        (c["type"], c.get("metricKey"), by_section[c["metricSectionId"]])
        for c in state["compareRunCharts"]
    ]
    assert charts == [
        ("BAR", "val/acc", "Objectives"),
        ("BAR", "throughput/samples_per_sec", "Objectives"),
        ("SCATTER", None, "Objectives"),  # the front
        ("LINE", "val/acc", "val"),  # MLflow charts a metric once: its curve stays home
        ("LINE", "throughput/samples_per_sec", "throughput"),
    ]
    front = state["compareRunCharts"][2]
    assert (front["xaxis"]["key"], front["yaxis"]["key"]) == (
        "throughput/samples_per_sec",
        "val/acc",
    )
    assert len({c["uuid"] for c in state["compareRunCharts"]}) == len(charts)


def test_one_objective_has_its_bar_and_no_front() -> None:
    charts, sections = view_charts(["memory/peak_bytes"])
    assert [(c["type"], c["metricKey"]) for c in charts] == [("BAR", "memory/peak_mib")]
    assert sections[-1]["name"] == "best/memory"  # the parent's best/memory/peak_bytes


def test_the_experiment_tag_is_a_view_mlflow_reads() -> None:
    """MLflow's envelope: a string name, a number createdAt and the state as a JSON string."""
    tags = experiment_tags(["val/loss"])
    view = json.loads(tags[VIEW_TAG])
    assert isinstance(view["name"], str) and isinstance(view["createdAt"], int)
    assert json.loads(view["state"]) == view_state(["val/loss"])
