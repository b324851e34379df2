"""What a study publishes as it goes: the recommended configuration (`best.yaml`), the
summary (`summary.md`, also the parent run's description) and the plots (`plots/`), on the
study's parent MLflow run, and `best.yaml` in the Hydra output directory.

Written again after a finished trial, at most every PUBLISH_EVERY_S; the plots at most every
PLOTS_EVERY_S from the study's start (drawing them takes 1.5-2 s on 2 CPU cores, which short
trials would otherwise pay again and again: a one-minute study drew them five times); both
always at the end. Everything is read back from the study, so any worker's publication shows
all trials.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from batchfit.common.overrides import BEST_FILE
from batchfit.common.redact import redact
from batchfit.search.core.record import records
from batchfit.search.core.study_config import RecommendRule, Target
from batchfit.search.core.trial_count import num_trained
from batchfit.search.results import plots, speed_check, summary
from batchfit.search.results.boundary import FIT_ATTR
from batchfit.search.results.recommend import Recommendation, best_document, recommend
from batchfit.search.study.decision import Decision
from batchfit.tracking.runs import RunLog
from batchfit.tracking.tags import RECOMMENDED_TAG

PUBLISH_EVERY_S = 15.0
PLOTS_EVERY_S = 60.0
PLOTS_PATH = "plots"
DESCRIPTION_CHARS = 8000  # MLflow's limit on a tag value (3.17)
CUT_NOTE = "\n\n... (the rest is in this run's summary.md)\n"


def description(summary: str) -> str:
    """The summary as a run description: MLflow keeps at most DESCRIPTION_CHARS of a tag
    (cutting longer ones anywhere, or refusing them), so a long one ends at a whole line."""
    if len(summary) <= DESCRIPTION_CHARS:
        return summary
    cut = summary.rfind("\n", 0, DESCRIPTION_CHARS - len(CUT_NOTE))
    return summary[:cut] + CUT_NOTE


class Results:
    def __init__(
        self,
        parent: RunLog,
        metrics: Sequence[str],
        rule: RecommendRule,
        overrides_of: Callable[[FrozenTrial], list[str]],
        output_dir: Path | None,
        margin: float | None = None,
        target: Target | None = None,
    ):
        self.parent = parent
        self.target = target  # search.target, for the time to target
        self.margin = margin  # search.preflight_margin, for memory_vs_batch.png
        self.metrics = list(metrics)
        self.rule = rule
        self.overrides_of = overrides_of  # FrozenTrial -> the overrides that train it again
        self.output_dir = output_dir  # the Hydra output directory (best.yaml), if any
        self._published_at: float | None = None
        self._plotted_at = time.monotonic()  # the first plots: PLOTS_EVERY_S after the start
        parent.save_view(self.metrics)  # the experiment's view: these objectives first

    @property
    def best_path(self) -> Path | None:
        return self.output_dir / BEST_FILE if self.output_dir else None

    def recommendation(self, study: optuna.Study) -> Recommendation | None:
        trials = study.get_trials(deepcopy=False)
        cells = study.user_attrs.get(FIT_ATTR) or ()
        return recommend(trials, self.rule, speed_check.stored(study), self.target, cells)

    def overrides(self, rec: Recommendation | None) -> list[str]:
        """The overrides that train `rec`'s configuration again."""
        return rec.overrides(self.overrides_of(rec.trial)) if rec is not None else []

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """Optuna callback: publish, unless that was done less than PUBLISH_EVERY_S ago;
        with the plots if they were drawn PLOTS_EVERY_S ago or more."""
        now = time.monotonic()
        if self._published_at is None or now - self._published_at >= PUBLISH_EVERY_S:
            self.publish(study, plotted=now - self._plotted_at >= PLOTS_EVERY_S)

    def best_yaml(self, study: optuna.Study, rec: Recommendation | None) -> str | None:
        """best.yaml for `rec`. Masked in both copies, like everything batchfit writes: a
        password in a URL comes back from its environment variable (see redact.py) on a
        rerun."""
        if rec is None:
            return None
        return redact(best_document(rec, study.study_name, self.overrides(rec)))

    def publish(
        self, study: optuna.Study, decided: Decision | None = None, plotted: bool = True
    ) -> Recommendation | None:
        """Publish what the study recommends now; at its end, the study's `decided` answer
        (search/study/decision.py), the same best.yaml whichever worker publishes it. `plotted`:
        the plots drawn again too."""
        rec = self.recommendation(study)
        if decided is not None:
            # The recommendation is a function of the finished trials and the stored speed
            # check, which the decision was made from.
            assert decided.trial == (rec.trial.number if rec else None), (decided, rec)
        overrides = self.overrides(rec)
        files = {"summary.md": summary.summary_markdown(study, self.metrics, rec, overrides)}
        document = decided.best_yaml if decided is not None else self.best_yaml(study, rec)
        if rec is not None and document is not None:
            files[BEST_FILE] = document
            if self.best_path is not None:
                self.best_path.parent.mkdir(parents=True, exist_ok=True)
                self.best_path.write_text(document)
            self.parent.tags({RECOMMENDED_TAG: rec.trial.number})
            self.parent.mark_recommended(rec.trial.number)  # its run: first in the view
        self.parent.description(description(files["summary.md"]))
        self.parent.artifacts({name: text.encode() for name, text in files.items()})
        if plotted:
            self._plot(study, rec)
        self._published_at = time.monotonic()
        return rec

    def _plot(self, study: optuna.Study, rec: Recommendation | None) -> None:
        self.parent.artifacts(
            plots.render(
                study,
                self.metrics,
                rec.trial.number if rec else None,
                self.margin,
                rec.by_time if rec else None,
                rec.planned if rec else None,
            ),
            PLOTS_PATH,
        )
        self._plotted_at = time.monotonic()


class StudyRun:
    """The study's parent run: counts per state and the best value of each objective."""

    def __init__(self, log: RunLog, metrics: list[str]):
        self.log = log
        self.metrics = metrics

    def update(self, study: Any) -> None:
        """Optuna callback: refresh counts and best values after each finished trial. Each
        best/<metric> is the best of that objective so far over all completed trials (one
        trial need not hold them all), so its chart only ever improves."""
        trials = study.get_trials(deepcopy=False)
        counts: dict[str, float] = {
            "trials/" + label.lower().replace(" (", "_").rstrip(")"): n
            for label, n in summary.counts_by_state(trials).items()
        }
        kept = records(trials)
        counts["trials/trained"] = num_trained(kept)  # what search.n_trials counts
        counts["trials/unbilled"] = sum(t.is_finished and t.is_unbilled for t in kept)
        complete = [t for t in trials if t.state == TrialState.COMPLETE and t.values]
        for i, (metric, direction) in enumerate(zip(self.metrics, study.directions, strict=True)):
            values = [t.values[i] for t in complete]
            if values:
                pick = max if direction == StudyDirection.MAXIMIZE else min
                counts[f"best/{metric}"] = pick(values)
        self.log.metrics(counts, step=len(trials), flush=True)

    def __call__(self, study: Any, trial: Any) -> None:
        self.update(study)
