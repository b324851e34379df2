#!/usr/bin/env bash
# The checks that need a GPU, in one call of under 8 minutes on one card, each section with a
# time budget, then a table of section -> PASS/FAIL/SKIP and seconds; the exit status is the
# verdict (0: every section passed or was skipped). Two lanes run side by side on the card
# (each process has its own allocator, so its memory figures are its own; the step times a
# section prints are taken beside the other lane's work, an upper bound of the card's own):
#   lane A: whether cuDNN honours CUDNN_CONV_WSCAP_DBG (bench/gpu/conv_cap.py: every convolution
#           call of small_cnn and resnet18 with the cap unset, 64, 8 and set late), pytest -m gpu
#           (the files that hold gpu tests: they collect without MLflow), the conv grid
#           (bench/prediction.py: predicted vs measured reserve, and step times), memory
#           snapshots of a small_cnn and a resnet18 run (bench/gpu/cuda_snapshot.py, into $OUT),
#           the real OOM boundary (bench/gpu/oom_limit.py);
#   lane B: a whole study on the card, the quick start and a Llama 3.2 1B LoRA one
#           (bench/gpu/study_on_card.py: every trial's predicted vs measured peak, joules from
#           NVML, the recommendation; tables into $OUT; needs MLflow on the card), the Llama 3.2 1B
#           cells with their step times (bench/gpu/gpu_llm.py), Llama 3 8B LoRA at 1 x 2048 tokens
#           in a fresh process (first step and host memory), QLoRA when bitsandbytes is there
#           (bench/prediction.py --qlora; skipped without it). The 8B cell at 4 x 2048 tokens runs
#           only with GPU_CHECKS_ALL=1 (and GPU_CHECKS_DEADLINE_S raised): the studies took its time.
# On the GPU machine, with the wheels it lacks in .whl/ (../shared/device-kit/prepare.sh):
#   bash .whl/on-device.sh bench/gpu_checks.sh
# Elsewhere:  bench/gpu_checks.sh   ($OUT defaults to mlruns/gpu-checks, which git ignores)
# GPU_CHECKS_DEADLINE_S (default 450) caps the whole: no section runs past it.
# GPU_CHECKS_DEVICE=cpu runs the same sections on a CPU (the language models as llama3_tiny, the
# OOM bisection as its dry run, the cap's calls at batch 2), one lane after the other, each
# budget and the deadline three times the card's: a check of the script itself, not of any
# GPU figure. GPU_CHECKS_SERIAL=1 runs lane B after lane A instead of beside it (0: beside).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export OUT=${OUT:-$PWD/mlruns/gpu-checks}
py=${PYTHON:-$(command -v python3 || command -v python)} # some images have no `python`
mkdir -p "$OUT"
logs=$(mktemp -d)
start=$(date +%s)
device=${GPU_CHECKS_DEVICE:-cuda}
scale=$([ "$device" = cpu ] && echo 3 || echo 1) # a CPU's budgets: the same work, slower
deadline=$((start + ${GPU_CHECKS_DEADLINE_S:-$((450 * scale))}))
tiny=() && [ "$device" = cpu ] && tiny=(--tiny)               # llama3_tiny on a CPU
quick=() && [ "$device" = cpu ] && quick=(--batch 2)            # the cap's calls, smaller
resolution=$([ "$device" = cpu ] && echo 0.01 || echo 2)     # MiB: the OOM bisection's step
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} PYTHONUNBUFFERED=1 # two lanes share the host's cores

# Modules each kind of section imports (top level), checked before it runs.
BASE="torch torchvision hydra omegaconf rich torchmetrics"
LLM="$BASE transformers peft accelerate"
STUDY="$BASE optuna mlflow"

missing() { # the modules of "$@" that cannot be imported here
  "$py" -c 'import importlib.util as u, sys
print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' "$@"
}

# section NAME BUDGET_S "MODULES" OPTIONAL_MODULE -- COMMAND...: runs COMMAND under `timeout`
# (its budget, cut to what is left before the deadline), its output in $logs/NAME.log, printed
# whole when it ends; its result (PASS, FAIL, SKIP, TIMEOUT, MISSING, NO-TIME) in NAME.result.
section() {
  local name=$1 budget=$2 modules=$3 optional=$4
  shift 5
  local log=$logs/$name.log t0 left result absent
  budget=$((budget * scale))
  t0=$(date +%s)
  left=$((deadline - t0))
  ((budget > left)) && budget=$left
  # shellcheck disable=SC2086 # the lists split into module names
  absent=$(missing $modules)
  if ((budget < 15)); then
    result=NO-TIME
    echo "not run: ${left}s left before the deadline" >"$log"
  elif [ -n "$absent" ]; then
    result=MISSING
    echo "not run: cannot import $absent" >"$log"
  elif [ -n "$optional" ] && [ -n "$(missing "$optional")" ]; then
    result=SKIP
    echo "skipped: $optional is not installed" >"$log"
  else
    echo "\$ $* (budget ${budget}s)" >"$log"
    timeout --kill-after=10 "$budget" "$@" >>"$log" 2>&1
    case $? in
      0) result=PASS ;;
      124 | 137) result=TIMEOUT ;;
      *) result=FAIL ;;
    esac
  fi
  echo "$result $(($(date +%s) - t0)) $budget" >"$logs/$name.result"
  {
    flock 9 2>/dev/null || true # one lane's log at a time
    printf '\n===== %s: %s in %ss =====\n' "$name" "$result" "$(($(date +%s) - t0))"
    cat "$log"
  } 9>>"$logs/print.lock"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
"$py" -c 'import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
for m in ("torchvision", "torchmetrics", "transformers", "peft", "accelerate", "optuna", "hydra",
          "sklearn", "bitsandbytes", "mlflow", "pytest", "psutil"):
    try:
        print("  " + m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(f"  {m}: not importable ({type(e).__name__})")'
echo "OUT=$OUT; deadline in $((deadline - start)) s"

# pytest -m gpu over every file that holds a gpu test: collecting the whole suite imports
# modules that need MLflow, which the GPU machine does not have.
mapfile -t gpu_tests < <(grep -rl --include='test_*.py' -e 'mark\.gpu' tests | sort)

lane_a() {
  section conv-cap 70 "$BASE" "" -- "$py" bench/gpu/conv_cap.py --device "$device" "${quick[@]}"
  # scikit-learn too, for test_predict's (data=digits): without it that one test fails.
  section pytest-gpu 70 "$BASE pytest optuna" "" -- \
    "$py" -m pytest -m gpu -n 0 -q -p no:cacheprovider "${gpu_tests[@]}"
  section conv-grid 100 "$BASE" "" -- \
    "$py" bench/prediction.py --device "$device" --models small_cnn resnet18 --batch-sizes 8 64 256 \
    --precisions fp32 bf16 --image-size 32
  section snapshots 50 "$BASE" "" -- "$py" bench/gpu/cuda_snapshot.py --device "$device" --out "$OUT"
  section oom-boundary 120 "$BASE transformers" "" -- "$py" bench/gpu/oom_limit.py --device "$device" --max-seconds 80 \
    --resolution-mib "$resolution"
}

lane_b() {
  section study-resnet 100 "$STUDY" "" -- \
    "$py" bench/gpu/study_on_card.py --experiment resnet --device "$device" --out "$OUT"
  section study-llm 140 "$STUDY $LLM" "" -- \
    "$py" bench/gpu/study_on_card.py --experiment llm --device "$device" --out "$OUT"
  section llm-1b 100 "$LLM" "" -- "$py" bench/gpu/gpu_llm.py --device "$device" "${tiny[@]}" --cells 1b
  section llm-8b-1x2048 60 "$LLM" "" -- "$py" bench/gpu/gpu_llm.py --device "$device" "${tiny[@]}" --cells 8b-lora-1x2048
  section qlora 40 "$LLM" bitsandbytes -- "$py" bench/prediction.py --no-grid --qlora --device "$device"
  if [ "${GPU_CHECKS_ALL:-0}" = 1 ]; then
    section llm-8b-4x2048 90 "$LLM" "" -- "$py" bench/gpu/gpu_llm.py --device "$device" "${tiny[@]}" --cells 8b-lora-4x2048
  else
    echo "SKIP 0 0" >"$logs/llm-8b-4x2048.result" # the studies took its time
  fi
}

if [ "${GPU_CHECKS_SERIAL:-$([ "$device" = cpu ] && echo 1 || echo 0)}" = 1 ]; then # a CPU
  lane_a
  lane_b
else
  lane_a &
  lane_b &
  wait
fi

echo
echo "===== summary ($(($(date +%s) - start)) s in all; files in $OUT: $(find "$OUT" -type f | wc -l), 8 come back) ====="
printf '%-16s %-8s %9s %9s\n' section result seconds budget
status=0
for name in conv-cap pytest-gpu conv-grid snapshots oom-boundary study-resnet study-llm llm-1b \
  llm-8b-1x2048 qlora llm-8b-4x2048; do
  read -r result seconds budget <"$logs/$name.result" 2>/dev/null || result=LOST
  printf '%-16s %-8s %9s %9s\n' "$name" "$result" "${seconds:--}" "${budget:--}"
  case $result in PASS | SKIP) ;; *) status=1 ;; esac
done
echo "verdict: $([ $status = 0 ] && echo PASS || echo FAIL)"
rm -rf "$logs"
exit $status
