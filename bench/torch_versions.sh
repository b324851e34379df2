#!/usr/bin/env bash
# The prediction tests on a second torch: by default the oldest that pyproject.toml allows
# (its torch and torchvision lower bounds), in a virtual environment of its own beside the
# project's, with the rest of batchfit's dependencies (pyproject's, the llm extra, the test
# tools) resolved around that torch. Prints how long the install took and what it weighed,
# then runs the tests that cover train/memory/ with -n 0. Exit status: pytest's.
#   bench/torch_versions.sh                          # torch and torchvision at pyproject's bounds
#   bench/torch_versions.sh 2.15.0 0.29.2            # another pair (0.29.2 allows torch>=2.14)
#   TORCH_VENV=/tmp/t211 bench/torch_versions.sh     # where the environment goes
# A second run reuses the environment (and pip's cache beside it): only the tests run again.
# Not in .ci/run: PyPI has only CUDA builds of an older torch (2.11: 530 MB, with ~1.9 GB of
# nvidia-* wheels to fetch where the machine lacks them); building the environment took
# 147-279 s and the tests 461 s on 2 shared cores, over CI's spare 5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
python=${PYTHON:-python3}

# pyproject's lower bounds, unless given: "torch>=2.11" -> 2.11.0
read -r default_torch default_vision < <("$python" - <<'PY'
import re
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
def bound(name):
    spec = next(d for d in deps if re.match(rf"{name}\s*[><=]", d))
    version = re.search(r">=\s*([0-9.]+)", spec).group(1)
    return version + ".0" * (2 - version.count("."))
print(bound("torch"), bound("torchvision"))
PY
)
torch_version=${1:-$default_torch}
vision_version=${2:-$default_vision}
venv=${TORCH_VENV:-${TMPDIR:-/tmp}/batchfit-torch-$torch_version}
echo "torch $torch_version, torchvision $vision_version in $venv"

received_bytes() {  # bytes received on every network interface so far (Linux)
  awk 'NR > 2 { total += $2 } END { printf "%.0f\n", total }' /proc/net/dev 2>/dev/null || echo 0
}

if [ ! -x "$venv/bin/python" ]; then
  start=$SECONDS
  received=$(received_bytes)
  "$python" -m venv "$venv"
  # The pins replace any constraints file of pip's configuration (PIP_CONSTRAINT wins over
  # pip.conf's constraint): only these two are held, everything else resolves around them.
  printf 'torch==%s\ntorchvision==%s\n' "$torch_version" "$vision_version" >"$venv/constraints.txt"
  # batchfit's requirements, not batchfit itself: an editable install would rewrite the
  # work tree's egg-info that the project's own environment reads; the tests import the
  # packages from the repository root (pyproject's pythonpath).
  "$python" - >"$venv/requirements.txt" <<'PY'
import re
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
test_tools = [d for d in extras["dev"] if re.match(r"(pytest|hypothesis)\b", d)]
print("\n".join(project["dependencies"] + extras["llm"] + test_tools))
PY
  PIP_CONSTRAINT="$venv/constraints.txt" PIP_CACHE_DIR="$venv.pip-cache" \
    "$venv/bin/pip" install -q --disable-pip-version-check -r "$venv/requirements.txt"
  echo "installed in $((SECONDS - start)) s: environment $(du -sh "$venv" | cut -f1)," \
    "$((($(received_bytes) - received) / 1000000)) MB received over the network meanwhile"
fi

"$venv/bin/python" -c "import sys, torch, torchvision, transformers, peft
print('python', sys.version.split()[0], 'torch', torch.__version__, 'torchvision',
      torchvision.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"

# Every test file that imports train.memory, plus the language-model prediction tests.
tests=(
  tests/train/test_cuda_emulation.py tests/train/test_cudnn.py
  tests/train/test_predict.py tests/train/test_predict_cuda.py tests/train/test_hf.py
  tests/train/test_allocator.py tests/train/test_allocator_invariants.py
  tests/train/test_memory.py tests/train/test_stack.py tests/train/test_quantize.py
  tests/train/test_checkpointing.py tests/train/test_workload.py tests/train/test_gpus.py
  tests/bench/test_cuda_trace.py tests/test_private_apis.py
)
start=$SECONDS
status=0
(cd "$repo" && "$venv/bin/python" -m pytest -n 0 -p no:cacheprovider -q "${tests[@]}") || status=$?
echo "tests took $((SECONDS - start)) s on torch $torch_version"
exit $status
