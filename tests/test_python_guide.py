"""The "Use batchfit from Python" guide (docs/python.md), run exactly as written: its Python
blocks in order, as one script, in a fresh folder that also holds a user's `train.py`,
`search.py`, `common/` and `tracking/` (each fails if imported: batchfit must never take
them for its own). A few lines appended after the guide's own measure what it predicted:
Lightning's real steps under the tracker that measures CPU runs, the Trainer's through the
guide's PredictionCallback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "python.md"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
SHADOWS = {  # a user's files named like batchfit's former top-level modules
    "train.py": "raise SystemExit('the user train.py was imported')\n",
    "search.py": "raise SystemExit('the user search.py was imported')\n",
    "common/__init__.py": "raise SystemExit('the user common/ was imported')\n",
    "tracking/__init__.py": "raise SystemExit('the user tracking/ was imported')\n",
}
# After the guide: Lightning trained again with a measuring callback beside the guide's,
# each step's peak of live tensors (state and batch registered: they exist before it);
# then what the test checks, as JSON.
EPILOGUE = """
import json
from batchfit.train.measure.memory import TensorMemoryTracker
from batchfit.train.step import state_tensors


class MeasuredSteps(pl.Callback):
    def __init__(self):
        self.peaks = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.tracker = TensorMemoryTracker()
        self.tracker.register(state_tensors(module, trainer.optimizers[0]))
        self.tracker.register(batch)
        self.tracker.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.tracker.__exit__(None, None, None)
        self.peaks.append(self.tracker.peak_bytes)


again, measured = PredictedBatchSize(budget="1MiB"), MeasuredSteps()
pl.Trainer(
    accelerator="cpu", max_steps=6, callbacks=[again, measured], logger=False,
    enable_checkpointing=False, enable_progress_bar=False,
).fit(Classifier())
parts = prediction.breakdown
print("RESULT " + json.dumps({
    "peak": prediction.peak_bytes,
    "parts": [parts.weights_bytes, parts.gradients_bytes, parts.optimizer_state_bytes,
              parts.activations_bytes, parts.workspace_bytes, parts.allocator_bytes],
    "fits": prediction.fits,
    "a100_workspace": on_a100.breakdown.workspace_bytes,
    "best": best.batch_size,
    "best_fits": best.fits,
    "table_rows": len(table.rows()),
    "llm_fits": step.predict(2, precision="bf16").fits,
    "lightning": [module.batch_size, trainer.accumulate_grad_batches],
    "lightning_predicted": [fitted.prediction.peak_bytes, again.prediction.peak_bytes],
    "lightning_measured": measured.peaks,
    "hf": [fitted_args.args.per_device_train_batch_size,
           fitted_args.args.gradient_accumulation_steps],
    "hf_predicted": fitted_args.prediction.peak_bytes,
    "hf_measured": peaks.measured,
    "rec": [rec.batch_size, rec.accum_steps, rec.precision, rec.lr, rec.command,
            str(rec.best_yaml), rec.overrides, rec.figures["val/loss"]],
}))
"""


def test_the_guide_runs_as_written_beside_a_users_train_py(tmp_path: Path) -> None:
    blocks = BLOCK.findall(GUIDE.read_text())
    assert len(blocks) >= 6, "the guide's Python blocks"
    for name, text in SHADOWS.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    script = tmp_path / "guide.py"
    script.write_text("\n\n".join(blocks) + EPILOGUE)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    found = json.loads(line.removeprefix("RESULT "))

    # Plain PyTorch: the parts add up to the peak; the A100's step holds cuBLAS's workspaces.
    assert sum(found["parts"]) == found["peak"] and found["fits"] is True
    assert found["a100_workspace"] == 2 * (4096 * 2 + 16 * 8) * 1024  # sm 8.0: two handles'
    assert found["best"] > 32 and found["best_fits"] and found["table_rows"] == 16
    assert found["llm_fits"] is True

    # Lightning: 256 samples a step asked for; 256 at once does not fit 1 MiB: 32 x 8. The
    # largest step Lightning measured is the prediction, to the byte (the first steps are
    # lower: the logged loss's accumulators are created in them).
    assert found["lightning"] == [32, 8]
    predicted, again = found["lightning_predicted"]
    assert predicted == again and max(found["lightning_measured"]) == predicted

    # Trainer: 16 x 1 asked for; the budget takes 2 x 8, the same 16 samples a step. The
    # measured step lacks only its micro-batches (fetched before on_step_begin; on a GPU
    # they are copied to the device within it): input_ids and labels, 2 x 32 int64 each.
    batch, accum = found["hf"]
    assert batch * accum == 16 and batch < 16
    measured = found["hf_measured"]
    assert len(measured) == 4 and found["hf_predicted"] - max(measured) == batch * 32 * 8 * 2

    # The study's recommendation as an object, the same as its best.yaml.
    size, accum_steps, precision, lr, command, best_yaml, overrides, val_loss = found["rec"]
    assert size in (16, 64) and accum_steps == 1 and precision == "fp32" and lr > 0
    assert command.startswith("python -m train ") and f"trainer.batch_size={size}" in command
    document = yaml.safe_load((tmp_path / best_yaml).read_text())
    assert document["overrides"] == overrides and document["values"]["val/loss"] == val_loss
