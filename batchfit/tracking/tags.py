"""The tags batchfit puts on MLflow runs, one constant each: what a run is (a study's parent,
a trial), whose it is, how it ended and why. search/ and train/ write them through
tracking/runs.py and read them back by these names; the MLflow UI's view (tracking/mlflow_ui.py)
shows some as columns.
"""

from __future__ import annotations

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: nests a trial's run under the study's
ROLE_TAG = "batchfit.role"  # study (the parent run), trial, or train (`python -m train`)
STUDY_TAG = "batchfit.study"
TRIAL_TAG = "batchfit.trial"  # the trial's number
STATE_TAG = "batchfit.state"  # COMPLETE, PRUNED or FAIL; KILLED: its worker died
PRUNE_REASON_TAG = "batchfit.prune_reason"  # why a trial was pruned (search/core/record.py)
# Its values that a run decides itself, the same for a trial and `python -m train`:
OOM = "oom"  # over the budget as it trained
DIVERGED = "diverged"  # NaN or infinite loss
NOTE_TAG = "mlflow.note.content"  # a run's description in the MLflow UI (markdown)
RECOMMENDED_TAG = "batchfit.recommended"  # the parent's: the trial's number; its run's: true
