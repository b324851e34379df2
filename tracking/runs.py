"""MLflow records: one experiment per study, a parent run per study, a nested run per trial.

Uses `MlflowClient` with explicit run ids (no fluent active-run stack), and batches: a trial
buffers its interval metrics and writes them with one `log_batch` per validation.

Several workers write to one store. Every write goes through an `Outbox` (tracking/outbox.py),
in order, retried while the store is away: the study goes on meanwhile, and nothing is lost
unless the store is still unreachable `mlflow.outage_wait_s` after the last trial.
The study's parent run is created once, by the worker that created the study's MLflow
experiment (MLflow refuses a second experiment of one name): the others wait for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import logging
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import sqlalchemy
from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tracking import interrupts
from tracking.config import ConfigError, section_from_mapping
from tracking.outbox import RETRY_MIN_S, Outbox, is_transient
from tracking.outputs import store_examples
from tracking.redact import redact

_logger = logging.getLogger(__name__)

PARENT_TAG = "mlflow.parentRunId"
ROLE_TAG = "batchfit.role"
STUDY_TAG = "batchfit.study"
TRIAL_TAG = "batchfit.trial"
STATE_TAG = "batchfit.state"
PRUNE_REASON_TAG = "batchfit.prune_reason"  # why a trial was pruned (search/record.py)
NOTE_TAG = "mlflow.note.content"  # a run's description in the MLflow UI (markdown)

RECOMMENDED_TAG = "batchfit.recommended"  # the parent's: the trial's number; its run's: true

# The MLflow UI (3.17) opens an experiment on its GenAI page unless the URL or the browser
# says otherwise; it ignores the experiment-kind tag (set anyway, for UIs that read it). A
# saved view (an experiment tag, see view_state) shows what matters; the link opens both.
KIND_TAG = "mlflow.experimentKind"
VIEW_KEY = "batchfit"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
VIEW_OBJECTIVES = ("val/acc",)  # conf/search/default.yaml's, until a study saves its own
VIEW_METRICS = (
    "throughput/samples_per_sec", "memory/peak_mib", "memory/predicted_mib", "time/trial_s",
)  # fmt: skip
VIEW_FIELDS = (
    "params.`trainer.batch_size`", "params.`trainer.accum_steps`",
    "params.`effective_batch_size`", "params.`trainer.precision`", "params.`lr_scaled`",
    "tags.`batchfit.state`", "tags.`batchfit.prune_reason`",
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
MIB = 2**20

PARENT_WAIT_S = 60.0  # how long a worker waits for the parent run another worker creates
FRESH_EXPERIMENT_S = 300.0  # an experiment younger than this may still be getting its parent
START_RETRY_S = 30.0  # reaching the store at start (SQLite schema being created by a peer)
# What MLflow's schema migrations meet in a SQLite store whose creation stopped part-way:
# they are not transactional, and the next run trips on what the last one left.
_HALF_MADE = re.compile(r"already exists|duplicate column|no such (table|column)", re.IGNORECASE)
# Tables a new MLflow store fills itself: the schema's version and the default workspace
# (and the Default experiment, id 0, which _empty_if_it_holds_nothing passes over).
_SEEDED_TABLES = ("alembic_version", "workspaces")
# A database server's answers that no wait changes: the URL names a database or user that is
# not there, or a password that is wrong.
_PERMANENT = re.compile(
    r'database "[^"]*" does not exist|role "[^"]*" does not exist|password authentication '
    r"failed|no pg_hba\.conf entry|Unknown database|Access denied for user",
    re.IGNORECASE,
)
CONNECT_TIMEOUT_S = 10  # the check of a database server's answer: no longer than this


# The tracking stores MLflow 3 has (a bare path is a file store too), as URI schemes; a
# database's driver follows a + (postgresql+psycopg). Plugins add theirs by entry point.
TRACKING_SCHEMES = (
    "sqlite", "postgresql", "mysql", "mssql", "http", "https", "file", "databricks",
)  # fmt: skip
TRACKING_EXAMPLES = (
    "mlflow.tracking_uri=sqlite:///mlruns/mlflow.db (a local file) or "
    "mlflow.tracking_uri=http://HOST:5000 (a tracking server)"
)


def tracking_schemes() -> tuple[str, ...]:
    plugins = importlib.metadata.entry_points(group="mlflow.tracking_store")
    return (*TRACKING_SCHEMES, *sorted(p.name for p in plugins))


@dataclass(frozen=True)
class MlflowConfig:
    """The `mlflow` section of the config (conf/config.yaml), checked before the first trial."""

    tracking_uri: str = "sqlite:///mlruns/mlflow.db"
    artifact_root: str = "mlruns/artifacts"  # where new experiments keep their artifacts
    outage_wait_s: float = 600.0  # checked with the study's settings (search/config.py)
    system_metrics: bool = True
    system_metrics_interval_s: float = 5.0

    def __post_init__(self) -> None:
        problems = []
        uri = self.tracking_uri
        scheme = urlparse(uri).scheme.split("+")[0].lower() if isinstance(uri, str) else None
        if not isinstance(uri, str) or not uri.strip():
            problems.append(
                f"mlflow.tracking_uri must be a tracking URI, got {uri!r}; e.g. "
                "mlflow.tracking_uri=sqlite:///mlruns/mlflow.db"
            )
        elif scheme and scheme not in tracking_schemes():
            problems.append(
                f"mlflow.tracking_uri={redact(uri)!r}: MLflow has no tracking store for "
                f"{scheme}://; it takes {', '.join(tracking_schemes())}; e.g. "
                f"{TRACKING_EXAMPLES}"
            )
        if not isinstance(self.artifact_root, str) or not self.artifact_root.strip():
            problems.append(
                f"mlflow.artifact_root must be a directory, got {self.artifact_root!r}; "
                "override with mlflow.artifact_root=mlruns/artifacts"
            )
        if not isinstance(self.system_metrics, bool):
            problems.append(
                f"mlflow.system_metrics must be true or false, got {self.system_metrics!r}; "
                "override with mlflow.system_metrics=true"
            )
        interval = self.system_metrics_interval_s
        if isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0:
            problems.append(
                f"mlflow.system_metrics_interval_s must be a number of seconds > 0, got "
                f"{interval!r}; override with mlflow.system_metrics_interval_s=5"
            )
        if problems:
            raise ConfigError(problems)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> MlflowConfig:
        return section_from_mapping(cls, "mlflow", values, owner="an mlflow setting")


def http_defaults() -> None:
    """MLflow's REST client retries a failed request 7 times over ~4 minutes, inside the
    call; the outbox retries instead, so a trial never blocks on a down server. MLflow also
    prints each run's URL, password included, to stdout; the study prints its own lines.
    A user's own setting of these variables wins."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


# MLflow's system-metrics thread logs a failed write with the whole database error in the
# message (a locked SQLite store: the SQL statement and its parameters, ~70 lines).
SYSTEM_METRICS_LOGGER = "mlflow.system_metrics.system_metrics_monitor"


class FirstLineFilter(logging.Filter):
    """Cuts a record's message to its first line, redacted, and says that the rest was left
    out; for a logger whose messages embed whole exception texts."""

    def filter(self, record: logging.LogRecord) -> bool:
        lines = record.getMessage().splitlines()
        if len(lines) > 1:
            left_out = len(lines) - 1
            record.msg = f"{redact(lines[0].rstrip())} [{left_out} more lines left out]"
            record.args = None
        return True


def quiet_logging() -> None:
    """MLflow's INFO chatter (schema migrations through alembic, the system-metrics monitor)
    would bury the trial lines, and its system-metrics thread's errors are one line each;
    the entry points call this, importing does not."""
    for name in ("alembic", "mlflow"):
        logging.getLogger(name).setLevel(logging.WARNING)
    monitor = logging.getLogger(SYSTEM_METRICS_LOGGER)
    if not any(isinstance(f, FirstLineFilter) for f in monitor.filters):
        monitor.addFilter(FirstLineFilter())


# Logged per interval while a run trains (the unit's throughput too, e.g. tokens_per_sec).
CURVE_METRICS = ("throughput/samples_per_sec", "time/data_wait_share")


def mib_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """memory/*_bytes figures in MiB too (memory/peak_mib), to 0.1 MiB: the runs table shows
    bytes as a 9-digit number, cut at its column's width."""
    return {
        f"{key.removesuffix('_bytes')}_mib": round(value / MIB, 1)
        for key, value in metrics.items()
        if key.startswith("memory/") and key.endswith("_bytes") and value == value
    }


def _shown(metric: str) -> str:
    """The metric that shows `metric`: memory in MiB (mib_metrics), others as they are."""
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
    view = {"name": "batchfit: trials", "createdAt": _now_ms(), "state": state}
    return {KIND_TAG: "custom_model_development", VIEW_TAG: json.dumps(view)}


def ui_link(tracking_uri: str, experiment_id: str) -> str:
    """Where the study's runs are in the MLflow UI, with batchfit's view of them."""
    base = tracking_uri if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    query = f"viewStateShareKey={VIEW_KEY}&workflowType=machine_learning"
    return f"{redact(base.rstrip('/'))}/#/experiments/{experiment_id}/runs?{query}"


def elsewhere_note(location: str, wanted: Path) -> str | None:
    """What to say when an experiment's artifacts are not where mlflow.artifact_root puts a
    new one's. MLflow stores an experiment's artifact location absolute, fixed at creation
    (a relative one is resolved against the working directory), and each run's too: a moved
    or copied project directory still writes into the old one, and batchfit cannot change
    that through MLflow's API. So it says so, once per start, instead."""
    parsed = urlparse(location)
    if parsed.scheme not in ("", "file"):
        return None  # a remote artifact store: not the project directory's
    path = Path(url2pathname(parsed.path)) if parsed.scheme else Path(location)
    if path == wanted.resolve():
        return None
    gone = "" if path.parent.exists() else ", which no longer exists"
    return (
        f"MLflow experiment {wanted.name!r} keeps its artifacts in {path}{gone}, not under "
        f"mlflow.artifact_root ({wanted.resolve().parent}): MLflow fixed that absolute path "
        "when it created the experiment, so this study's artifacts go there. To keep them with "
        "this project, start a new MLflow store (e.g. mlflow.tracking_uri=sqlite:///"
        "mlruns/mlflow-moved.db) or move the project back"
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


def _sqlite_path(uri: str) -> Path | None:
    path = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else ""
    return Path(path) if path and path != ":memory:" else None


def _cannot_use(uri: str, error: BaseException, fix: str | None = None) -> ConfigError:
    reason = redact(str(error).splitlines()[0]) if str(error) else ""
    return ConfigError(
        [
            f"mlflow.tracking_uri={redact(uri)!r} cannot be used ({type(error).__name__}: "
            f"{reason}); "
            + (
                fix
                or f"start the tracking server, or use a local store, e.g. {store_examples()[1]}"
            )
        ]
    )


def _check_database(uri: str) -> None:
    """Ask a database server once whether the URL's database can be used. MLflow retries
    reaching it for two minutes whatever the server said, as for a server still starting;
    one that answers that the database does not exist (or refuses the user) answers so
    every time. Any other failure is left to MLflow's retries."""
    if not uri.startswith(("postgresql", "mysql")):
        return
    try:  # a URL it cannot parse, a driver not installed: MLflow's own attempt says which
        url = sqlalchemy.engine.make_url(uri)
        timeout = {} if "connect_timeout" in url.query else {"connect_timeout": CONNECT_TIMEOUT_S}
        engine = sqlalchemy.create_engine(
            url, poolclass=sqlalchemy.pool.NullPool, connect_args=timeout
        )
    except Exception:  # noqa: BLE001 - reported by the store's own opening
        return
    try:
        with engine.connect():
            pass
    except Exception as error:
        if _PERMANENT.search(str(error)):
            raise _cannot_use(
                uri,
                error,
                "the server answered, so waiting will not help: create the database, or fix "
                "the URL's database name, user or password",
            ) from None
    finally:
        engine.dispose()


def _open_client(uri: str) -> MlflowClient:
    """A client whose store is open (MLflow creates or migrates a SQLite schema at its first
    call). A SQLite store whose creation a full disk cut short fails every later run ("table
    _alembic_tmp_runs already exists"): holding nothing, it is emptied and made anew; holding
    something, it is left as it is and the error says what to do."""
    try:
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)
        return client
    except Exception as error:
        path = _sqlite_path(uri)
        if path is None or not _HALF_MADE.search(str(error)):
            raise
        reason = str(error).splitlines()[0]
        try:
            emptied = _empty_if_it_holds_nothing(path)
        except sqlite3.Error as failure:
            raise ConfigError([_half_made_advice(uri, path, reason, str(failure))]) from None
        if not emptied:
            raise ConfigError(
                [_half_made_advice(uri, path, reason, "it holds experiments or runs")]
            ) from None
    _logger.warning(
        "MLflow's store %s was half-made (its creation stopped part-way, as on a full disk: "
        "%s) and held nothing: made anew",
        path,
        reason,
    )
    client = MlflowClient(uri)
    client.search_experiments(max_results=1)
    return client


def _empty_if_it_holds_nothing(path: Path) -> bool:
    """Drop every table of the SQLite store if it holds nothing but what MLflow puts in a new
    one (whatever its schema's state; a table a migration was copying counts); True if it
    did. In place, in one transaction: MLflow keeps one engine per URI, whose pooled
    connections would still write to a file moved aside."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("BEGIN IMMEDIATE")  # no other writer between the check and the drop
        objects = db.execute(
            "SELECT type, name FROM sqlite_master "
            "WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite_%'"
        ).fetchall()
        for kind, name in objects:
            where = " WHERE experiment_id != 0" if name == "experiments" else ""
            seeded = name in _SEEDED_TABLES or kind == "view"
            if not seeded and db.execute(f'SELECT 1 FROM "{name}"{where} LIMIT 1').fetchone():
                db.execute("ROLLBACK")
                return False
        for kind, name in objects:
            db.execute(f'DROP {kind.upper()} IF EXISTS "{name}"')
        db.execute("COMMIT")
    return True


def _half_made_advice(uri: str, path: Path, reason: str, kept_because: str) -> str:
    return (
        f"mlflow.tracking_uri={redact(uri)!r}: the store {path} was left half-made (MLflow's "
        f"schema migration stopped part-way, as on a full disk: {redact(reason)}), and batchfit "
        f"left it as it is ({kept_because}). MLflow cannot finish that migration: move it "
        f"aside to start a new store there (mv {path} {path}.broken), or use another, e.g. "
        f"mlflow.tracking_uri=sqlite:///{path.with_name('mlflow-new.db')}"
    )


@contextlib.contextmanager
def _schema_lock(uri: str) -> Iterator[None]:
    """Workers opening one new SQLite store together would each run MLflow's schema
    migrations on it and break them; a file lock beside the database lets one go first."""
    path = _sqlite_path(uri)
    if path is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "w")  # noqa: SIM115 - closed below
    except OSError as error:
        raise _cannot_use(uri, error) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class RunLog:
    """One MLflow run with buffered metrics; its id is known once the outbox created it."""

    def __init__(self, client: MlflowClient, outbox: Outbox, run_id: str | None = None):
        self.client = client
        self.outbox = outbox
        self.run_id = run_id
        self._pending: list[Metric] = []
        # Uploads still queued, by artifact path: a newer version of the same files joins
        # the queued one instead of queueing again (plots are megabytes, redrawn often).
        # (The outbox writes in this thread, between calls: nothing else touches them.)
        self._uploads: dict[str | None, dict[str, bytes]] = {}

    def metrics(self, values: Mapping[str, float], step: int = 0, flush: bool = False) -> None:
        now = _now_ms()
        self._pending += [Metric(k, float(v), now, step) for k, v in values.items()]
        if flush:
            self.flush()

    def end_figures(self, metrics: Mapping[str, float], last_step: int) -> None:
        """A run's end figures (a trial's, `python -m train`'s), NaN left out, with
        memory/*_mib beside memory/*_bytes. At step 0: MLflow's chart view draws a metric
        whose last step is 0 as one bar per run (a comparison), not as a one-point line.
        Figures with a curve (throughput, logged per interval) end at `last_step` instead."""
        known = {k: v for k, v in metrics.items() if v == v}
        curves = {
            k: v for k, v in known.items() if k in CURVE_METRICS or k.startswith("throughput/")
        }
        figures = {k: v for k, v in {**known, **mib_metrics(known)}.items() if k not in curves}
        self.metrics(figures, step=0)
        if curves:
            self.metrics(curves, step=last_step)

    def validation(self, step: int, metrics: Mapping[str, Any]) -> None:
        """A validation's figures (the `/`-named ones of the training loop's on_eval) at
        `step`, written now; with the epoch as a metric of its own, which the UI's charts
        can use as their x-axis to compare runs of different step sizes."""
        figures = {k: v for k, v in metrics.items() if "/" in k}
        figures["train/epoch"] = metrics["epoch"]
        self.metrics(figures, step, flush=True)

    def flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self.outbox.put(lambda: self.client.log_batch(self.run_id, metrics=batch))

    def params(self, values: Mapping[str, Any]) -> None:
        # MlflowClient.log_batch splits into chunks within the server's per-request limits.
        params = [Param(k, redact(_param_str(v))) for k, v in values.items()]
        self.outbox.put(lambda: self.client.log_batch(self.run_id, params=params))

    def tags(self, values: Mapping[str, Any]) -> None:
        tags = [RunTag(k, redact(str(v))) for k, v in values.items()]
        self.outbox.put(lambda: self.client.log_batch(self.run_id, tags=tags))

    def text(self, text: str, artifact_file: str) -> None:
        masked = redact(text)
        self.outbox.put(lambda: self.client.log_text(self.run_id, masked, artifact_file))

    def table(self, columns: Mapping[str, list], artifact_file: str) -> None:
        """A table (column name -> values) the MLflow UI shows as one (artifact view)."""
        data = dict(columns)
        self.outbox.put(
            lambda: self.client.log_table(self.run_id, data=data, artifact_file=artifact_file)
        )

    def artifacts(self, files: Mapping[str, bytes], artifact_path: str | None = None) -> None:
        """Files (name -> content) under `artifact_path`, replacing earlier versions. While
        an upload to the same path waits in the outbox (MLflow away or busy), these files
        replace its contents: one upload, of the newest versions."""
        queued = self._uploads.get(artifact_path)
        if queued is not None:
            queued.update(files)
            return
        contents = self._uploads[artifact_path] = dict(files)

        def upload() -> None:
            with tempfile.TemporaryDirectory() as folder:
                for name, content in contents.items():
                    (Path(folder) / name).write_bytes(content)
                self.client.log_artifacts(self.run_id, folder, artifact_path)
            del self._uploads[artifact_path]  # written: a new version queues anew

        self.outbox.put(upload)

    def rename(self, name: str) -> None:
        self.outbox.put(lambda: self.client.update_run(self.run_id, name=name))

    def description(self, markdown: str) -> None:
        """The run's description, shown rendered at the top of its page in the MLflow UI."""
        self.tags({NOTE_TAG: markdown})

    def save_view(self, objectives: Sequence[str]) -> None:
        """batchfit's saved view (view_state) on this run's experiment, for these objectives."""
        tags = experiment_tags(objectives)

        def write() -> None:
            experiment_id = self.client.get_run(self.run_id).info.experiment_id
            for key, value in tags.items():
                self.client.set_experiment_tag(experiment_id, key, value)

        self.outbox.put(write)

    def mark_recommended(self, trial_number: int) -> None:
        """Tag the run of this (parent) run's trial `trial_number` RECOMMENDED_TAG=true, and
        untag the one that was: the recommendation moves as trials finish, and any worker
        may have tagged the last one."""

        def write() -> None:
            experiment_id = self.client.get_run(self.run_id).info.experiment_id
            children = f"tags.`{PARENT_TAG}` = '{self.run_id}'"
            marked = self.client.search_runs(
                [experiment_id], f"{children} and tags.`{RECOMMENDED_TAG}` = 'true'"
            )
            chosen = self.client.search_runs(
                [experiment_id], f"{children} and tags.`{TRIAL_TAG}` = '{trial_number}'"
            )
            chosen_ids = {run.info.run_id for run in chosen}
            for run in marked:
                if run.info.run_id not in chosen_ids:
                    self._untag(run.info.run_id, RECOMMENDED_TAG)
            for run_id in chosen_ids - {run.info.run_id for run in marked}:
                self.client.set_tag(run_id, RECOMMENDED_TAG, "true")

        self.outbox.put(write)

    def _untag(self, run_id: str, key: str) -> None:
        """Delete a tag another worker may have deleted since it was read: gone either way."""
        try:
            self.client.delete_tag(run_id, key)
        except MlflowException:
            if key in self.client.get_run(run_id).data.tags:
                raise

    def finish(self, status: str = "FINISHED") -> None:
        self.flush()
        end_ms = _now_ms()
        self.outbox.put(
            lambda: self.client.set_terminated(self.run_id, status=status, end_time=end_ms)
        )


def _param_str(value: Any) -> str:
    return "null" if value is None else str(value)


def _retry_at_start(call: Callable[[], Any], tracking_uri: str) -> Any:
    """`call`, retried on passing failures for START_RETRY_S: workers starting together on
    one new SQLite store race to create its schema, and a server may be starting."""
    deadline = time.monotonic() + START_RETRY_S
    delay = RETRY_MIN_S
    while True:
        try:
            with interrupts.deferred():  # as the outbox's writes (tracking/interrupts.py)
                return call()
        except ConfigError:
            raise  # already says what to do
        except Exception as error:
            retry = is_transient(error) or "already exists" in str(error)
            if not retry or time.monotonic() > deadline:
                raise _cannot_use(tracking_uri, error) from None
            time.sleep(delay)
            delay = min(2 * delay, 2.0)


class Tracker:
    """The MLflow side of a study or a single run."""

    def __init__(
        self,
        tracking_uri: str,
        experiment_name: str,
        artifact_root: str,
        system_metrics_interval_s: float | None = None,
    ):
        self.tracking_uri = tracking_uri
        # MLflow's system metrics (CPU, memory, GPU) per run, sampled this often; None: off
        self.system_metrics_interval_s = system_metrics_interval_s
        self.outbox = Outbox()
        self.created_experiment = False  # True in the one worker that created it
        _check_database(tracking_uri)
        with _schema_lock(tracking_uri):  # MlflowClient creates or migrates the schema
            self.client = _retry_at_start(lambda: _open_client(tracking_uri), tracking_uri)
            self.experiment_id = _retry_at_start(
                lambda: self._experiment(experiment_name, artifact_root), tracking_uri
            )

    def _experiment(self, name: str, artifact_root: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            if VIEW_TAG not in found.tags:  # made before batchfit saved its view
                for key, value in experiment_tags().items():
                    self.client.set_experiment_tag(found.experiment_id, key, value)
            moved = elsewhere_note(found.artifact_location, Path(artifact_root) / name)
            if moved:
                _logger.warning(moved)
            return found.experiment_id
        location = (Path(artifact_root).resolve() / name).as_uri()
        try:
            experiment_id = self.client.create_experiment(
                name, artifact_location=location, tags=experiment_tags()
            )
        except MlflowException:  # another worker created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id
        self.created_experiment = True
        return experiment_id

    @classmethod
    def from_config(cls, mlflow: Any, experiment_name: str) -> Tracker:
        """From the `mlflow` config node (conf/config.yaml)."""
        interval = mlflow.system_metrics_interval_s if mlflow.system_metrics else None
        return cls(mlflow.tracking_uri, experiment_name, mlflow.artifact_root, interval)

    @contextlib.contextmanager
    def system_metrics(self, run_id: str | None) -> Iterator[None]:
        """MLflow's system metrics monitor on this run while the block runs (a thread that
        samples CPU, memory and GPU every system_metrics_interval_s and logs `system/*`)."""
        if not self.system_metrics_interval_s or run_id is None:
            yield
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(
            run_id,
            sampling_interval=self.system_metrics_interval_s,
            samples_before_logging=1,
            tracking_uri=self.tracking_uri,
        )
        monitor.start()
        try:
            yield
        finally:
            monitor.finish()

    def start_run(self, name: str, tags: Mapping[str, Any], parent_id: str | None = None) -> RunLog:
        all_tags = {k: redact(str(v)) for k, v in tags.items()}
        if parent_id:
            all_tags[PARENT_TAG] = parent_id
        log = RunLog(self.client, self.outbox)

        def create() -> None:
            run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
            log.run_id = run.info.run_id

        self.outbox.put(create)
        return log

    def resume_run(self, run_id: str | None) -> RunLog | None:
        """The run with this id, set back to RUNNING; None if it is gone from the store."""
        if not run_id:
            return None
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return None
        if run.info.experiment_id != self.experiment_id:
            return None
        self.client.update_run(run_id, status="RUNNING")
        return RunLog(self.client, self.outbox, run_id)

    def study_run(self, study_name: str, known_id: str | None) -> tuple[RunLog, bool]:
        """The study's parent run and whether this worker created it. It is created once:
        by the worker that created the experiment, or, for an experiment that has been
        there a while without one, by the first worker that finds it so."""
        resumed = _retry_at_start(
            lambda: self.resume_run(known_id) or self.resume_run(self._find_study_run(study_name)),
            self.tracking_uri,
        )
        if resumed is not None:
            return resumed, False
        if not self.created_experiment and self._experiment_is_fresh():
            deadline = time.monotonic() + PARENT_WAIT_S
            while time.monotonic() < deadline:
                time.sleep(0.2)
                found = _retry_at_start(
                    lambda: self.resume_run(self._find_study_run(study_name)), self.tracking_uri
                )
                if found is not None:
                    return found, False
        tags = {ROLE_TAG: "study", STUDY_TAG: study_name}
        run = _retry_at_start(
            lambda: self.client.create_run(self.experiment_id, run_name=study_name, tags=tags),
            self.tracking_uri,
        )
        return RunLog(self.client, self.outbox, run.info.run_id), True

    def _find_study_run(self, study_name: str) -> str | None:
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{ROLE_TAG}` = 'study' and tags.`{STUDY_TAG}` = '{study_name}'",
            order_by=["attributes.start_time ASC"],
            max_results=1,
        )
        return runs[0].info.run_id if runs else None

    def _experiment_is_fresh(self) -> bool:
        experiment = _retry_at_start(
            lambda: self.client.get_experiment(self.experiment_id), self.tracking_uri
        )
        created_ms = experiment.creation_time or 0
        return _now_ms() - created_ms < FRESH_EXPERIMENT_S * 1000

    def end_killed_runs(self, trial_numbers: set[int]) -> list[int]:
        """End as KILLED the runs of these trials (whose workers died); the trial numbers
        whose runs were ended. A run may have FINISHED already: its worker died after
        closing it, before the trial's state reached the study, which runs it again."""
        if not trial_numbers:
            return []
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"attributes.status != 'KILLED' and tags.`{ROLE_TAG}` = 'trial'",
        )
        ended = []
        for run in runs:
            number = int(run.data.tags.get(TRIAL_TAG, -1))
            if number in trial_numbers:
                log = RunLog(self.client, self.outbox, run.info.run_id)
                log.tags({STATE_TAG: "KILLED"})
                log.finish(RunStatus.to_string(RunStatus.KILLED))
                ended.append(number)
        return ended

    def close(self, timeout_s: float) -> bool:
        """Wait for queued writes; False if some are still unwritten after `timeout_s`."""
        return self.outbox.wait(timeout_s)
