"""Metric names, one constant each: what a run logs to MLflow and a trial keeps in its record.

Names use `/` namespaces (`val/acc`, `throughput/samples_per_sec`, `memory/peak_bytes`) and
units in the name; every module that writes or reads a figure by name imports it from here,
so that a name is spelled once. The task-dependent ones (a task's own validation metrics,
its throughput unit) are built by `val` and `throughput`. What each one means is told where
it is measured (train/loop.py, train/measure/, train/run.py, search/).
"""

from __future__ import annotations

# Validation (train/tasks.py: a task's metrics, prefixed)
VAL_PREFIX = "val/"
VAL_LOSS = "val/loss"
VAL_ACC = "val/acc"
VAL_PERPLEXITY = "val/perplexity"

# Training, logged per interval (train/loop.py)
TRAIN_LOSS = "train/loss"
TRAIN_LR = "train/lr"
TRAIN_EPOCH = "train/epoch"
TRAIN_FINAL_LOSS = "train/final_loss"  # the last logged train/loss of a run

# Throughput (train/measure/throughput.py): units of the task per second of timed steps
THROUGHPUT_PREFIX = "throughput/"
THROUGHPUT_SAMPLES = "throughput/samples_per_sec"
THROUGHPUT_TOKENS = "throughput/tokens_per_sec"
THROUGHPUT_SPREAD = "throughput/spread"  # (fastest - slowest) / median of the timed windows
SCALING_EFFICIENCY = "throughput/scaling_efficiency"  # search/trial/scaling.py

# Memory (train/memory/): bytes; the MiB copies are for the MLflow runs table
MEMORY_PREFIX = "memory/"
PEAK_BYTES = "memory/peak_bytes"
RESERVED_BYTES = "memory/reserved_bytes"
BUDGET_BYTES = "memory/budget_bytes"
PREDICTED_BYTES = "memory/predicted_bytes"
PREDICTED_RESERVED_BYTES = "memory/predicted_reserved_bytes"
# the largest cuDNN convolution workspace a CUDA prediction counted for one call: the cap
# (cudnn_workspace_mib) for a card planned from elsewhere, measured on the card itself
CUDNN_WORKSPACE_BYTES = "memory/cudnn_workspace_bytes"
PREDICTION_ERROR = "memory/prediction_error"  # (predicted - measured) / measured
PEAK_MIB = "memory/peak_mib"
PREDICTED_MIB = "memory/predicted_mib"
BUDGET_MIB = "memory/budget_mib"

# Time: seconds, milliseconds or a share of the training time
STEP_MS = "time/step_ms"  # one optimizer step, timed steps only
DATA_WAIT_SHARE = "time/data_wait_share"  # share of timed seconds spent waiting for data
TRAIN_S = "time/train_s"  # training seconds so far, validation excluded
TO_TARGET_S = "time/to_target_s"  # training seconds until validation first met search.target
TRIAL_S = "time/trial_s"  # the whole trial
STORAGE_S = "time/storage_s"  # its Optuna storage calls (tracking/overhead.py)
TRACKING_S = "time/tracking_s"  # its MLflow calls
PREDICTION_S = "time/prediction_s"  # its memory prediction
PROJECTED_S = "time/projected_s"  # a `slow` trial's projected training

# Energy (train/measure/energy.py): joules the hardware's own counters (NVML, RAPL) counted
# over the timed steps, the same window as time/step_ms, summed over a run's devices and ranks
ENERGY_PREFIX = "energy/"
ENERGY_J = "energy/joules"
ENERGY_PER_SAMPLE = "energy/joules_per_sample"
MEAN_WATTS = "energy/mean_watts"  # energy/joules / the timed seconds
TO_TARGET_J = "energy/to_target_j"  # mean watts x time/to_target_s: the joules to search.target
# The device's mean utilisation over the timed steps, a share (0-1): NVML's GPU utilisation
# on a GPU, the process's CPU time / (wall time x its threads) on a CPU
DEVICE_PREFIX = "device/"
DEVICE_UTILIZATION = "device/utilization"

# The gradient noise scale (train/measure/noise.py): B_simple and its two parts, means over
# the run's measured steps; B_simple's 95% interval (Fieller's) and the steps it rests on
GRAD_NOISE_SCALE = "stats/grad_noise_scale"
GRAD_NOISE_SCALE_LOW = "stats/grad_noise_scale_low"
GRAD_NOISE_SCALE_HIGH = "stats/grad_noise_scale_high"
GRAD_NOISE_STEPS = "stats/grad_noise_scale_steps"
GRAD_SQ_NORM = "stats/grad_sq_norm"
GRAD_VARIANCE = "stats/grad_variance"

# Performance (train/measure/flops.py)
FLOPS_PER_SAMPLE = "perf/flops_per_sample"
ACHIEVED_FLOPS = "perf/achieved_flops"
PEAK_FLOPS = "perf/peak_flops"
MFU = "perf/mfu"  # model FLOPs utilisation: achieved / peak


def val(name: str) -> str:
    """A task's validation metric by its own name: val('acc') == VAL_ACC."""
    return f"{VAL_PREFIX}{name}"


def throughput(unit: str) -> str:
    """The throughput of a task counting `unit`: throughput('samples') == THROUGHPUT_SAMPLES."""
    return f"{THROUGHPUT_PREFIX}{unit}_per_sec"


def joules_per(unit: str) -> str:
    """Joules per unit of a task counting `unit`: joules_per('samples') == ENERGY_PER_SAMPLE."""
    return f"{ENERGY_PREFIX}joules_per_{unit.removesuffix('s')}"


def rank_peak_bytes(rank: int) -> str:
    """One rank's measured peak in a distributed run."""
    return f"memory/rank_{rank}/peak_bytes"
