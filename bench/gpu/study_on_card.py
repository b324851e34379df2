"""A whole study on the card: `python -m search` as a user runs it (trials, the preflight's
predictions, pruning, the speed check, energy, MLflow), in this process through
`batchfit.study`, then one row per trial: its configuration, state and reason, the predicted
and the measured peak (CUDA: the reserve under the trial's limit against max_memory_reserved),
the error, the step time, the joules and their source; and the recommendation. The table is
printed and written to OUT/study-EXPERIMENT.md.

- `--experiment resnet`: the quick start (`+experiment=resnet`) on synthetic 32 px images (no
  download on the card), a few trials;
- `--experiment llm`: `+experiment=llm_lora model.config=llama3_2_1b` (Llama 3.2 1B, LoRA) over a
  narrow space (batch 2 or 4 of 512 or 1024 tokens, bf16).

Verdict (the exit status): at least one trial trained; no trial FAILed; no trial ran out of
memory after its prediction said it fits (a "fits" that OOMs is a bug); on CUDA every trained
trial's prediction within 15% of the measured reserve and none under it by more than 2% (the
prediction grid's targets), and, where NVML can be read (nvidia-ml-py), joules counted for every
trained trial; a recommendation. `--device cpu` runs the same on the CPU with a small CNN and
llama3_tiny: a check of the script, whose memory verdict is the CPU accounting's.

    python bench/gpu/study_on_card.py --experiment resnet --out mlruns/gpu-checks
    python bench/gpu/study_on_card.py --experiment llm --device cpu
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from batchfit.search.core.record import OOM, Attr  # noqa: E402
from batchfit.tracking.metrics import ENERGY_J, STEP_MS  # noqa: E402
from batchfit.train.device.sizes import format_bytes  # noqa: E402

LLM_SPACE = (
    '++search.params={trainer.batch_size:"choice(2,4)",trainer.accum_steps:"choice(1)",'
    'trainer.precision:"choice(bf16)",data.seq_len:"choice(512,1024)",'
    'trainer.activation_checkpointing:"choice(none)",model.lora.r:"choice(8)",'
    'optimizer.lr:"tag(log, interval(3e-4, 3e-3))"}'
)
STUDIES = {
    ("resnet", "cuda"): [
        "+experiment=resnet", "data=synthetic", "data.num_samples=8192", "search.n_trials=4",
        "search.trial_time_budget_s=30", "search.timeout_s=80", "search.sampler.n_startup_trials=4",
    ],
    ("resnet", "cpu"): [
        "+experiment=resnet", "model=small_cnn", "data=synthetic", "data.num_samples=512",
        "data.image_size=16", "search.n_trials=3", "search.trial_time_budget_s=30",
        '++search.params={trainer.batch_size:"choice(32,64)",trainer.accum_steps:"choice(1,2)",'
        'trainer.precision:"choice(fp32)",optimizer.lr:"tag(log, interval(0.01, 0.2))"}',
    ],
    ("llm", "cuda"): [
        "+experiment=llm_lora", "model.config=llama3_2_1b", "search.n_trials=3",
        "search.trial_time_budget_s=40", "search.timeout_s=110", LLM_SPACE,
    ],
    ("llm", "cpu"): [
        "+experiment=llm_lora", "model.config=llama3_tiny", "data.max_bytes=20000",
        "search.n_trials=2", "search.trial_time_budget_s=30",
        '++search.params={trainer.batch_size:"choice(2,4)",trainer.accum_steps:"choice(1)",'
        'trainer.precision:"choice(fp32)",data.seq_len:"choice(64)",'
        'trainer.activation_checkpointing:"choice(none)",model.lora.r:"choice(8)",'
        'optimizer.lr:"tag(log, interval(3e-4, 3e-3))"}',
    ],
}  # fmt: skip
WITHIN, UNDER = 0.15, -0.02  # the prediction grid's targets (bench/prediction.py)


def run_study(overrides: list[str], console: Console):  # noqa: ANN201 - batchfit.StudyResult
    import batchfit

    return batchfit.study(overrides, console=console)


def rows(result) -> list[dict]:  # noqa: ANN001 - a batchfit.StudyResult
    """One dict per trial, from the study's records (the user attrs of search/core/record.py)."""
    out = []
    for trial in result.study.trials:
        attrs = trial.user_attrs
        metrics = attrs.get(Attr.METRICS) or {}
        out.append(
            {
                "trial": trial.number,
                "params": ", ".join(f"{k.split('.')[-1]}={v}" for k, v in trial.params.items()),
                "state": attrs.get(Attr.STATE) or trial.state.name,
                "reason": attrs.get(Attr.REASON) or "",
                "predicted": attrs.get(Attr.PREDICTED_BYTES),
                "measured": attrs.get(Attr.PEAK_BYTES),
                "error": attrs.get(Attr.PREDICTION_ERROR),
                "budget": attrs.get(Attr.BUDGET_BYTES),
                "step_ms": metrics.get(STEP_MS),
                "joules": metrics.get(ENERGY_J),
            }
        )
    return out


def table(found: list[dict], title: str) -> Table:
    out = Table(title=title)
    for column in ("trial", "configuration", "state", "predicted", "measured", "error",
                   "step ms", "joules"):  # fmt: skip
        out.add_column(column, justify="left" if column == "configuration" else "right")
    for r in found:
        state = r["state"] + (f" ({r['reason']})" if r["reason"] else "")
        out.add_row(
            str(r["trial"]),
            r["params"],
            state,
            format_bytes(r["predicted"]) if r["predicted"] else "-",
            format_bytes(r["measured"]) if r["measured"] else "-",
            f"{r['error']:+.2%}" if r["error"] is not None else "-",
            f"{r['step_ms']:.1f}" if r["step_ms"] is not None else "-",
            f"{r['joules']:.0f}" if r["joules"] is not None else "-",
        )
    return out


def verdict(found: list[dict], cuda: bool, energy: bool, recommended: bool) -> list[str]:
    """What fails the study's check, in words (empty: PASS)."""
    problems = []
    trained = [r for r in found if r["state"] == "COMPLETE" or r["step_ms"] is not None]
    if not trained:
        problems.append("no trial trained")
    problems += [f"trial {r['trial']} FAILed" for r in found if r["state"] == "FAIL"]
    for r in found:
        fits = r["predicted"] is not None and (r["budget"] is None or r["predicted"] <= r["budget"])
        if r["reason"] == OOM and fits:
            problems.append(f"trial {r['trial']} ran out of memory after a prediction that fits")
    for r in trained:
        error = r["error"]
        if cuda and error is not None and not (UNDER <= error <= WITHIN):
            problems.append(f"trial {r['trial']}: prediction {error:+.2%} off (target "
                            f"{UNDER:+.0%} to {WITHIN:+.0%})")  # fmt: skip
        if energy and not r["joules"]:
            problems.append(f"trial {r['trial']}: no joules counted though NVML is readable")
    if not recommended:
        problems.append("no recommendation")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", choices=("resnet", "llm"), default="resnet")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "mlruns")))
    args = parser.parse_args()
    console = Console(width=160)
    cuda = args.device == "cuda"
    overrides = [*STUDIES[args.experiment, args.device], f"trainer.device={args.device}"]
    overrides.append(f"search.study_name=on-card-{args.experiment}")
    energy = cuda and importlib.util.find_spec("pynvml") is not None
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:  # its own mlruns/: a fresh study each time
        os.chdir(work)
        result = run_study(overrides, console)
        found = rows(result)
    title = f"Study on {args.device}: {args.experiment}, predicted vs measured peak per trial"
    shown = table(found, title)
    console.print(shown)
    rec = result.recommendation
    said = f"recommended: {rec.command}" if rec is not None else "recommended: none"
    console.print(said, soft_wrap=True)
    problems = verdict(found, cuda, energy, rec is not None)
    for problem in problems:
        console.print(f"[red]- {problem}[/red]")
    console.print(f"verdict: {'PASS' if not problems else 'FAIL'}")
    recorder = Console(record=True, width=160, file=open(os.devnull, "w"))  # noqa: SIM115
    recorder.print(shown)
    text = recorder.export_text()
    (out / f"study-{args.experiment}.md").write_text(
        f"```text\n{text}```\n\n{said}\n\nverdict: {'PASS' if not problems else 'FAIL'}\n"
        + "".join(f"- {p}\n" for p in problems)
    )
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
