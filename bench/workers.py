"""What several workers buy, and what sharing a study costs.

The same small study (small_cnn on digits, one epoch a trial, TPE) runs with 1, 2 and 4
local workers (`python -m search`, or `--multirun hydra/launcher=joblib search.workers=N`),
on each storage path:
- journal: the study in a journal file, MLflow in a local SQLite store (the defaults);
- postgresql: the study in PostgreSQL, MLflow in a local SQLite store (needs a server:
  --postgres URL or $BATCHFIT_PG_URL, e.g. from tests/cluster/services.sh up).
For each run it prints the trials per minute (first trial's start to last trial's end, so
process start-up is left out) and the coordination overhead per trial: the seconds a trial's
worker spent in storage calls (`time/storage_s`: the sampler reading all trials, the trial's
writes) and in MLflow calls (`time/tracking_s`), median over the study's trials.

    python bench/workers.py                         # 12 trials, 1/2/4 workers, journal (+ PG)
    python bench/workers.py --trials 20 --workers 1 2 --postgres postgresql://u@h/db

Verdict (exit status 1 otherwise): every study ends with exactly --trials finished trials,
and the median coordination overhead per trial of every path is under --max-coordination-ms
(500 ms: under 1% of a one-minute trial; these trials last about a second, so their share
is shown too but not judged). Speed-up is bounded by the cores: a 2-core machine runs 2
trials at once at most, and 4 workers there share 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import optuna
from optuna.trial import TrialState
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from batchfit.search.core.record import records  # noqa: E402

STUDY = [
    "model=small_cnn",
    "model.width=8",
    "data=digits",
    "trainer.max_epochs=1",
    "trainer.device=cpu",
    "search.study_name=bench",
    "search.objectives=[val/acc,throughput/samples_per_sec]",
    "+search.params={trainer.batch_size:'choice(16,32,64,128)',"
    "optimizer.lr:'tag(log, interval(0.01, 0.3))'}",
]
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def _postgres_database(server: str) -> str:
    """A new database on the server, for one study."""
    import psycopg

    name = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    return server.rsplit("/", 1)[0] + f"/{name}"


def run_study(workers: int, trials: int, storage: str | None, workdir: Path) -> dict:
    args = [*STUDY, f"search.n_trials={trials}"]
    if storage:
        args.append(f"search.storage={storage}")
    if workers > 1:
        args = ["--multirun", "hydra/launcher=joblib", f"hydra.launcher.n_jobs={workers}",
                f"search.workers={workers}", *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "search", *args],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the study failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    if storage is None:
        backend = optuna.storages.journal.JournalFileBackend(
            str(workdir / "mlruns" / "optuna.journal")
        )
        storage = optuna.storages.JournalStorage(backend)
    study = optuna.load_study(study_name="bench", storage=storage)
    finished = [t for t in study.trials if t.state in FINISHED]
    kept = records(finished)
    span_s = (
        max(t.datetime_complete for t in finished) - min(t.datetime_start for t in finished)
    ).total_seconds()
    return {
        "finished": len(finished),
        "trials": len(study.trials),
        "wall_s": wall_s,
        "per_min": 60 * len(finished) / span_s,
        "trial_s": statistics.median(t.seconds for t in kept),
        "storage_s": statistics.median(t.storage_s for t in kept),
        "tracking_s": statistics.median(t.tracking_s for t in kept),
        "coordination_s": statistics.median(t.storage_s + t.tracking_s for t in kept),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--postgres", default=os.environ.get("BATCHFIT_PG_URL"))
    parser.add_argument("--max-coordination-ms", type=float, default=500.0)
    options = parser.parse_args()
    console = Console(width=140)
    paths = [("journal", None)]
    if options.postgres:
        paths.append(("postgresql", options.postgres))
    else:
        console.print("[yellow]no PostgreSQL server (--postgres or BATCHFIT_PG_URL): journal only")
    table = Table(title=f"{options.trials} trials, local workers, {os.cpu_count()} CPU cores")
    for column in (
        "storage", "workers", "finished/trials", "trials/min", "speed-up", "trial s (median)",
        "storage s/trial", "MLflow (SQLite) s/trial", "coordination s/trial", "share",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    ok = True
    for name, server in paths:
        base = None
        for workers in options.workers:
            with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
                storage = _postgres_database(server) if server else None
                result = run_study(workers, options.trials, storage, Path(tmp))
            base = base or result["per_min"]
            share = result["coordination_s"] / result["trial_s"]
            exact = result["finished"] == options.trials == result["trials"]
            ok &= exact and result["coordination_s"] * 1000 < options.max_coordination_ms
            table.add_row(
                name, str(workers), f"{result['finished']}/{result['trials']}",
                f"{result['per_min']:.1f}", f"{result['per_min'] / base:.2f}x",
                f"{result['trial_s']:.2f}", f"{result['storage_s'] * 1000:.0f} ms",
                f"{result['tracking_s'] * 1000:.0f} ms",
                f"{result['coordination_s'] * 1000:.0f} ms", f"{share:.1%}",
            )  # fmt: skip
            console.print(f"{name}, {workers} workers: done in {result['wall_s']:.0f} s")
    console.print(table)
    console.print(
        f"Speed-up is bounded by the cores: {os.cpu_count()} here, so at most "
        f"{os.cpu_count()} trials run at once, and more workers than cores share them."
    )
    verdict = "PASS" if ok else "FAIL"
    console.print(
        f"{verdict}: every study must end with exactly {options.trials} trials, and "
        f"coordination stay under {options.max_coordination_ms:g} ms per trial"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
