"""What a trial records in Optuna, by name: the user attrs that search/objective.py writes
and the report, the plots, the recommendation and the sampler read. (The run's own params,
batch size to scaled lr, are named in train/run.py.)"""

from __future__ import annotations

STATE = "state"  # COMPLETE, PRUNED or FAIL, as the trial ended
REASON = "reason"  # why a trial was pruned: OOM_REASONS, diverged, slow, pruner
MESSAGE = "message"  # what happened, in words
PEAK = "peak_bytes"  # measured peak memory (past the memory check)
PREDICTED = "predicted_bytes"  # the preflight prediction
BUDGET = "budget_bytes"
THROUGHPUT = "throughput"  # UNIT/s of a completed trial
UNIT = "unit"  # what THROUGHPUT counts: the task's unit, samples or tokens
VAL_ACC = "val_acc"
METRICS = "metrics"  # a completed trial's figures by metric name
PROBE = "probe_s_per_sample"  # the slow-trial probe's seconds per sample (search/objective.py)
PROJECTED = "projected_s"  # a `slow` trial's projected training seconds ...
TIME_BUDGET = "time_budget_s"  # ... and the search.trial_time_budget_s it was held to
MFU_NOTE = "mfu_note"  # why a completed trial's perf/mfu is above 1 (train/flops.py)
PREDICTED_OOM = "oom_predicted"  # the reason of a trial whose step was predicted not to fit
OOM_REASONS = ("oom", PREDICTED_OOM)
MISSED_TARGET = "missed_target"  # pruned at the end of its budget short of search.target
