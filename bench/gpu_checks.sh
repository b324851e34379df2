#!/usr/bin/env bash
# The checks that need a GPU, in one run (a few minutes on one card): the `gpu` tests, the
# prediction grid against max_memory_reserved, and the real OOM boundary, bisected under
# set_per_process_memory_fraction, against the predicted one. Exit status 1 if any fails.
#   bench/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
pytest -m gpu -n 0 -q -p no:cacheprovider || status=1
python bench/prediction.py --device cuda --models small_cnn resnet18 --batch-sizes 8 64 256 \
  --precisions fp32 bf16 || status=1
python bench/prediction.py --no-grid --qlora --device cuda || status=1
python bench/oom_limit.py || status=1
python bench/prediction.py --no-grid --traces tests/fixtures/cuda-traces || status=1
exit $status
