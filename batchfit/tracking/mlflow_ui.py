"""batchfit's saved view of an experiment in the MLflow UI, and the link that opens it.

The study's link (`ui_link`) opens its experiment's runs table sorted with the recommended
trial first, every trial a row of its own, the objectives and the figures every study has as
columns (memory in MiB), and a chart view that starts with the objectives. MLflow has no
public API for that: the UI saves a view as an experiment tag, `mlflow.sharedViewState.<key>`,
holding the JSON of its own page state, and opens it from a `viewStateShareKey=<key>` link.
batchfit writes that tag (`experiment_tags`) when it creates an experiment, and again when a
study saves its objectives (tracking/runs.py `RunLog.save_view`).

Why `mlflow<3.18` (pyproject.toml). That JSON is the UI's private state, not an interface:
its keys (orderByKey, selectedColumns, columnWidths, runsHiddenMode, compareRunCharts, ...)
and each chart's fields are those MLflow 3.17's JavaScript reads, copied from its own charts,
and they change with the UI without notice. A newer UI that renames or drops one fails
nothing: the link still opens, and the view quietly loses that part (the sort, and with it
the recommended trial first and the trials unfolded; the columns; the charts), or, if it
cannot read the tag at all, MLflow reports an error loading the shared view and shows its
default experiment page. So the pin holds the UI at the version whose reading of this view
is tested. (Besides, 3.18's mlflow-skinny is missing from some indexes, which sends pip
backtracking over versions.)

To check a newer MLflow, with it installed in a scratch environment:
- `pytest tests/tracking/test_mlflow_ui.py -k mlflows_ui_reads`: reads the new UI's bundle
  (mlflow/server/js/build/static/js) for the keys a shared view may set, and fails on a key
  of `view_state` that is no longer among them;
- `BATCHFIT_REQUIRE_BROWSER=1 BATCHFIT_SCREENSHOTS=/tmp/shots pytest tests/test_browser.py`:
  a study, `mlflow server` on its store and headless Chromium on the printed link; it checks
  the rows, their order, the mark, the columns and the charts, and leaves screenshots.
If both pass and the screenshots look right, raise the pin in pyproject.toml and the version
named here. If not, find the renamed keys in the new bundle and follow them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from batchfit.common.redact import redact
from batchfit.tracking.metrics import PEAK_MIB, PREDICTED_MIB, THROUGHPUT_SAMPLES, TRIAL_S, VAL_ACC
from batchfit.tracking.tags import PRUNE_REASON_TAG, RECOMMENDED_TAG, STATE_TAG

# The MLflow UI (3.17) opens an experiment on its GenAI page unless the URL or the browser
# says otherwise; it ignores the experiment-kind tag (set anyway, for UIs that read it). A
# saved view (an experiment tag, see view_state) shows what matters; the link opens both.
KIND_TAG = "mlflow.experimentKind"
VIEW_KEY = "batchfit"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
VIEW_OBJECTIVES = (VAL_ACC,)  # conf/search/default.yaml's, until a study saves its own
VIEW_METRICS = (THROUGHPUT_SAMPLES, PEAK_MIB, PREDICTED_MIB, TRIAL_S)
VIEW_FIELDS = (
    "params.`trainer.batch_size`", "params.`trainer.accum_steps`",
    "params.`effective_batch_size`", "params.`trainer.precision`", "params.`lr_scaled`",
    f"tags.`{STATE_TAG}`", f"tags.`{PRUNE_REASON_TAG}`",
)  # fmt: skip
RUN_NAME_COLUMN = "attributes.`Run Name`"
RECOMMENDED_COLUMN = f"tags.`{RECOMMENDED_TAG}`"
OBJECTIVES_SECTION = "batchfit-objectives"
# The chart view's sections after the objectives', in this order, by metric prefix (MLflow
# files a metric under its name less the last part); each has charts in every study (those
# holding an objective keep its curve). The parent run's trials/* and best/* come folded;
# others (perf/*, system/*) MLflow appends.
CHART_SECTIONS = ("val", "throughput", "memory", "time", "train")
CURVE_SECTIONS = ("val", "throughput")  # of metrics logged per validation or interval


def _shown(metric: str) -> str:
    """The metric that shows `metric`: memory in MiB (tracking/runs.py mib_metrics), others
    as they are."""
    if metric.startswith("memory/") and metric.endswith("_bytes"):
        return f"{metric.removesuffix('_bytes')}_mib"
    return metric


def view_columns(objectives: Sequence[str]) -> list[str]:
    """The runs table's columns: the recommended mark, the objectives, then the figures and
    the configuration every study has."""
    metrics = dict.fromkeys([*map(_shown, objectives), *VIEW_METRICS])
    return [RECOMMENDED_COLUMN, *(f"metrics.`{m}`" for m in metrics), *VIEW_FIELDS]


def _width(column: str) -> int:
    """Pixels that show a column's name (`metrics.`memory/peak_mib`` shows as its name) and
    a value's 16 digits."""
    return max(150, 7 * len(column.split("`")[1]) + 48)


def _section(name: str, display: bool = True) -> dict[str, Any]:
    uuid = f"batchfit-{name}"
    return {"uuid": uuid, "name": name, "display": display, "isReordered": False}


def _line(metric: str, section: str) -> dict[str, Any]:
    """A line chart of `metric` over steps, with the fields of MLflow 3.17's own."""
    return {
        "uuid": f"batchfit-{metric}-curve", "type": "LINE", "metricKey": metric,
        "selectedMetricKeys": [metric], "displayName": metric.rsplit("/", 1)[-1],
        "metricSectionId": section, "isGenerated": True, "deleted": False,
        "lineSmoothness": 0, "xAxisScaleType": "linear", "scaleType": "linear",
        "range": {}, "xAxisKey": "step", "selectedXAxisMetricKey": "", "yAxisKey": "metric",
        "yAxisExpressions": [], "ignoreOutliers": False, "useGlobalXaxisKey": True,
        "useGlobalLineSmoothing": True,
    }  # fmt: skip


def view_charts(objectives: Sequence[str]) -> tuple[list[dict], list[dict]]:
    """(charts, sections) of the chart view: a section of the objectives first, a bar per
    objective (its last value per run) and the first two against each other (the front),
    then CHART_SECTIONS, then the parent run's folded."""
    shown = list(dict.fromkeys(map(_shown, objectives)))
    charts: list[dict[str, Any]] = [
        # Not "generated": MLflow turns a generated bar of a stepped metric into a line.
        {"uuid": f"batchfit-{metric}", "type": "BAR", "metricKey": metric,
         "displayName": metric, "metricSectionId": OBJECTIVES_SECTION, "isGenerated": False,
         "deleted": False}
        for metric in shown
    ]  # fmt: skip
    if len(shown) > 1:
        charts.append(
            {"uuid": "batchfit-front", "type": "SCATTER", "metricSectionId": OBJECTIVES_SECTION,
             "xaxis": {"key": shown[1], "type": "METRIC"},
             "yaxis": {"key": shown[0], "type": "METRIC"},
             "runsCountToCompare": 100, "isGenerated": False, "deleted": False}
        )  # fmt: skip
    # MLflow charts a metric once: an objective's curve stays in its own section.
    charts += [
        _line(metric, f"batchfit-{prefix}")
        for metric in shown
        for prefix in CURVE_SECTIONS
        if metric.startswith(f"{prefix}/")
    ]
    parents = ["trials", *dict.fromkeys(f"best/{m.rsplit('/', 1)[0]}" for m in objectives)]
    sections = [
        {**_section("Objectives"), "uuid": OBJECTIVES_SECTION},
        *map(_section, CHART_SECTIONS),
        *(_section(name, display=False) for name in parents),
    ]
    return charts, sections


def view_state(objectives: Sequence[str]) -> dict[str, Any]:
    """What the saved view sets, in the keys MLflow 3.17's UI reads from it (the search
    facets and the UI state of its experiment page; it drops runsExpanded, runsPinned,
    runsHidden and runsVisibilityMap from a shared view, so no parent run can be opened
    and no run hidden from here)."""
    columns = view_columns(objectives)
    charts, sections = view_charts(objectives)
    return {
        # Sorted by the mark, the recommended trial comes first; and in any order but its
        # default one (by start time) MLflow lists child runs as rows of their own, not
        # folded under their parent: every trial shows without a click.
        "orderByKey": RECOMMENDED_COLUMN,
        "orderByAsc": False,
        "selectedColumns": columns,
        "columnOrder": [RUN_NAME_COLUMN, *columns],
        # Run names carry the outcome: shown whole; the others as wide as their names.
        "columnWidths": {RUN_NAME_COLUMN: 460, **{c: _width(c) for c in columns}},
        "runsHiddenMode": "SHOW_ALL",  # the chart view draws every run, not the first 10
        "hideEmptyCharts": True,
        "isAccordionReordered": True,  # the sections in view_charts' order, not by name
        "compareRunCharts": charts,
        "compareRunSections": sections,
    }


def experiment_tags(objectives: Sequence[str] = VIEW_OBJECTIVES) -> dict[str, str]:
    state = json.dumps(view_state(objectives))
    view = {"name": "batchfit: trials", "createdAt": int(time.time() * 1000), "state": state}
    return {KIND_TAG: "custom_model_development", VIEW_TAG: json.dumps(view)}


def ui_link(tracking_uri: str, experiment_id: str) -> str:
    """Where the study's runs are in the MLflow UI, with batchfit's view of them."""
    base = tracking_uri if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    query = f"viewStateShareKey={VIEW_KEY}&workflowType=machine_learning"
    return f"{redact(base.rstrip('/'))}/#/experiments/{experiment_id}/runs?{query}"
