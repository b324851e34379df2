"""Accuracy and cost of the peak-memory prediction (train/memory/predict.py) against real runs.

For each model x precision x batch size, a prediction (a step on fake tensors) and a real
run of 3 optimizer steps through `train.run.run`, the code path of a trial:

- CPU: the measurement is the tracked tensor peak of `fit` (steps 0 and the steady step),
  the same accounting as the prediction, so this is a consistency check: target |error| <= 1%.
- CUDA (where a GPU is present): the measurement is `torch.cuda.max_memory_reserved`, what
  actually runs out; the prediction replays the step's allocations through the caching
  allocator model. Targets: median |error| <= 5%, worst <= 15%, and no cell under-predicted
  by more than 2% (each fits the card: an under-prediction there is a "fits" that runs out).
  The table also shows the error of live tensors alone against `max_memory_allocated`.

Also printed: seconds per prediction against seconds per real optimizer step.

    python bench/prediction.py                      # CPU grid (skips cells too slow to run)
    python bench/prediction.py --models resnet18 --batch-sizes 1 8 64 512 --image-size 32
    python bench/prediction.py --device cuda        # on a GPU: the allocator comparison
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python bench/prediction.py --device cuda
    python bench/prediction.py --traces tests/fixtures/cuda-traces   # + real GPU traces
    python bench/prediction.py --decoders           # + fit-report cost: 125M, 1B, 8B decoders
    python bench/prediction.py --no-grid --traces tests/fixtures/cuda-traces --decoders
    python bench/prediction.py --no-grid --fit-reports   # the four 8B fit reports
    python bench/prediction.py --no-grid --qlora    # QLoRA steps: 4-bit weights, bitsandbytes

`--traces DIR` replays real GPU memory snapshots (torch.cuda.memory._dump_snapshot files)
through the allocator model (bench/gpu/cuda_trace.py): per trace and device, the share of
events whose reserved bytes and segment count equal the real ones, the smallest
per-process limit the model runs it in against the same figure from the real events, the
peak reserved and whether a real OOM is predicted. Targets: 100% of events, every real OOM
predicted, limits within 2%.

`--decoders` times `python -m search.fit` for GPT decoders of ~125M, 1B and 8B parameters
planned for an H100 (search.gpu=H100-80GB, bf16 and fp32, micro-batches 1-8 of 1024
tokens) in fresh processes, and reads their peak host memory. Target for 1B and 8B: under
60 s and 2 GiB each (the model is built on fake tensors: no weights exist).

`--fit-reports` times the four 8B reports of docs/language-models.md (Llama 3 8B on an H100:
LoRA over `llm_lora`'s space, full fine-tuning in bfloat16, full fine-tuning as one rank of
FSDP over 8 GPUs; and QLoRA, the same space in NF4 on an RTX 4090), each `python -m
search.fit` in a fresh process, with its peak host memory, the tables it printed and when
the first one appeared; then, for cells of each (the shortest data.seq_len, without and with
checkpointing, batch 1 and 2, accumulation 1 and 2, each precision), the fast path (the step
built from 2-4 layer copies, train/memory/stack.py) against the full fake step of all 32
layers: smallest limit, live tensor peak and reserve under the budget. Verdict: the LoRA and QLoRA
reports under 30 s each (issue 41: 49 s and 65 s on a 2-core machine), the others under 60 s,
and every compared cell equal to the byte; exit status 1 otherwise.

On CPUs without bf16/fp16 kernels a real low-precision step is ~100x slower than fp32; cells
whose real run is estimated to take more than --max-run-s seconds are predicted but not
measured, and listed as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.train.device.sizes import format_bytes  # noqa: E402
from batchfit.train.measure.memory import release_memory  # noqa: E402
from batchfit.train.plan import plan  # noqa: E402
from batchfit.train.run import run  # noqa: E402
from batchfit.train.workload import Workloads  # noqa: E402

MODELS = ["small_cnn", "mlp", "resnet18", "resnet50"]
PRECISIONS = ["fp32", "bf16", "fp16"]
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def _config(model: str, device: str, image_size: int, num_samples: int):  # noqa: ANN202
    return compose(
        config_name="config",
        overrides=[
            f"model={model}",
            "data=synthetic",
            f"data.image_size={image_size}",
            f"data.num_samples={num_samples}",
            "data.val_fraction=0.02",
            "trainer.max_epochs=null",
            "trainer.max_steps=3",  # step 0, the steady step 1 and one timed step
            "trainer.warmup_steps=0",
            f"trainer.device={device}",
        ],
    )


# Decoders of the GPT of train/language/text.py over bytes (vocab 256): (layers, width, heads).
DECODERS = {"125M": (18, 768, 12), "1B": (20, 2048, 16), "8B": (40, 4096, 32)}
DECODER_LIMIT_S, DECODER_LIMIT_BYTES = 60.0, 2 * 2**30
DECODER_SPACE = (
    '++search.params={trainer.batch_size:"choice(1,2,4,8)",trainer.precision:"choice(bf16,fp32)",'
    'trainer.accum_steps:"choice(1)",data.seq_len:"choice(1024)"}'
)


def traces(console: Console, folder: str) -> bool:
    """The allocator model against real traces; True when every target holds."""
    from bench.gpu.cuda_trace import reports, table

    rows = reports(folder)
    console.print(table(rows))
    exact = all(r.replay.match_share == 1.0 for r in rows)
    ooms = all(r.replay.model_oom == r.replay.real_oom for r in rows)
    worst = max(
        abs(r.limits.model_smallest_limit_bytes - r.real_limit_bytes) / r.real_limit_bytes
        for r in rows
    )
    verdict = exact and ooms and worst <= 0.02
    console.print(
        f"{len(rows)} device traces: every event exact: {exact}; real OOMs predicted: {ooms}; "
        f"smallest limit, model vs real events, worst {worst:.2%} (target 2%): "
        f"[bold]{'PASS' if verdict else 'FAIL'}[/bold]"
    )
    return verdict


def decoders(console: Console) -> bool:
    """Seconds and peak host memory of a fit report per decoder, each in a fresh process."""
    table = Table(title="Fit report for H100-80GB, planned here: cost per decoder")
    for column in ("decoder", "parameters", "seconds", "peak host memory", "cells", "within"):
        table.add_column(column, justify="right")
    verdict = True
    for name, (layers, width, heads) in DECODERS.items():
        params = 12 * layers * width**2 + 256 * width + 1024 * width  # blocks, tok, pos
        args = [
            "+experiment=gpt", f"model.n_layer={layers}", f"model.n_embd={width}",
            f"model.n_head={heads}", "data.seq_len=1024", "search.gpu=H100-80GB",
            "search.memory_budget=null", DECODER_SPACE,
        ]  # fmt: skip
        seconds, rss, out, returncode, _ = _timed_fit(args)
        rows = [line for line in out.splitlines() if line.count("│") > 2]
        cells = sum(line.count(" GiB") + line.count(" MiB") for line in rows)
        ok = returncode == 0 and cells > 0
        if name != "125M":
            ok = ok and seconds < DECODER_LIMIT_S and rss < DECODER_LIMIT_BYTES
        verdict = verdict and ok
        if returncode != 0:
            console.print(out[-6000:])
        table.add_row(
            name, f"{params / 1e9:.2f} B", f"{seconds:.1f}", format_bytes(rss), str(cells),
            "yes" if ok else "NO",
        )  # fmt: skip
    console.print(table)
    console.print(
        f"1B and 8B: under {DECODER_LIMIT_S:.0f} s and {format_bytes(DECODER_LIMIT_BYTES)} "
        f"each: [bold]{'PASS' if verdict else 'FAIL'}[/bold]"
    )
    return verdict


# The 8B reports of docs/language-models.md: (name, overrides); cells compared at the first
# seq_len of llm_lora.
FIT_REPORTS = {
    "8B LoRA": ["+experiment=llm_lora", "model.config=llama3_8b", "search.gpu=H100-80GB"],
    "8B QLoRA": [
        "+experiment=llm_lora", "model.config=llama3_8b", "model.quantization=nf4",
        "search.gpu=RTX-4090",
    ],
    "8B full": [
        "+experiment=llm_full", "model.config=llama3_8b", "model.dtype=bfloat16",
        "search.gpu=H100-80GB",
    ],
    "8B FSDP x8": [
        "+experiment=llm_full", "model.config=llama3_8b", "model.dtype=bfloat16",
        "trainer.strategy=fsdp", "trainer.devices=8", "search.gpu=H100-80GB",
    ],
}  # fmt: skip
FIT_REPORT_LIMIT_S = 60.0
# Issue 41: the LoRA and QLoRA reports, 49 s and 65 s on a 2-core machine, under 30 s each
FIT_REPORT_TARGETS_S = {"8B LoRA": 30.0, "8B QLoRA": 30.0}


def fit_reports(console: Console) -> bool:
    """Each 8B report's wall time and host memory in a fresh process, then its fast path
    against the full fake step on a few cells; True when all are fast and exact."""
    table = Table(title="8B fit reports for an H100 (QLoRA: an RTX 4090), planned here")
    columns = ("report", "seconds", "target s", "first table s", "peak host memory", "tables")
    for column in (*columns, "cells", "within"):
        table.add_column(column, justify="right")
    verdict = True
    for name, overrides in FIT_REPORTS.items():
        seconds, rss, out, code, first_s = _timed_fit(overrides)
        tables = out.count("Fit report for")
        cells = sum(line.count(" GiB") for line in out.splitlines() if line.count("│") > 2)
        target = FIT_REPORT_TARGETS_S.get(name, FIT_REPORT_LIMIT_S)
        ok = code == 0 and tables > 0 and seconds < target
        verdict = verdict and ok
        if code != 0:
            console.print(out[-3000:])
        first = "-" if first_s is None else f"{first_s:.1f}"
        row = (name, f"{seconds:.1f}", f"{target:.0f}", first, format_bytes(rss), str(tables))
        table.add_row(*row, str(cells), "yes" if ok else "NO")
    console.print(table)
    exact = all(_compare_fast_and_whole(console, name, o) for name, o in FIT_REPORTS.items())
    console.print(
        f"every report within its target: {verdict}; fast path equal to the "
        f"full fake step on every compared cell: {exact}: "
        f"[bold]{'PASS' if verdict and exact else 'FAIL'}[/bold]"
    )
    return verdict and exact


# QLoRA cells: the tiny Llama's linear layers in NF4 (bitsandbytes), bf16 compute; the
# micro-batch sets the rows of each 4-bit matmul (batch x 256 tokens), which decide on CUDA
# between bitsandbytes' fused kernel and dequantize + matmul (train/language/quantize.py).
QLORA_CELLS = [(1, "fp32"), (4, "fp32"), (4, "bf16"), (8, "bf16")]


def qlora(console: Console, device: str) -> bool:
    """QLoRA steps predicted and run: on CPU the prediction must equal the measurement to
    the byte; on CUDA the reserve within the grid's targets (median 5%, worst 15%)."""
    table = Table(title=f"QLoRA (nf4, double quantization) on {device}: predicted vs measured")
    for column in ("batch x tokens", "precision", "predicted", "measured", "error"):
        table.add_column(column, justify="right")
    errors = []
    for batch_size, precision in QLORA_CELLS:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                "+experiment=llm_qlora", "model.quantization=nf4", "model.compute_dtype=bfloat16",
                f"trainer.batch_size={batch_size}", f"trainer.precision={precision}",
                "data.seq_len=256", "trainer.max_epochs=null", "trainer.max_steps=3",
                f"trainer.device={device}", "search.memory_budget=null",
            ])  # fmt: skip
        spec = plan(cfg, None)
        workload = Workloads().of(cfg)
        prediction = workload.predict(spec, cfg.optimizer)
        measured = run(cfg, spec, workload=workload)
        error = prediction.error(measured)
        errors.append(error)
        predicted = prediction.reserved_bytes or prediction.peak_bytes
        actual = measured.reserved_bytes or measured.peak_bytes
        table.add_row(
            f"{batch_size} x 256", precision, format_bytes(predicted), format_bytes(actual),
            f"{error:+.2%}",
        )  # fmt: skip
    console.print(table)
    worst = max(abs(e) for e in errors)
    if device == "cpu":
        verdict = worst == 0
        console.print(f"QLoRA on CPU: prediction = measurement in every cell: {verdict}")
    else:
        median = sorted(abs(e) for e in errors)[len(errors) // 2]
        verdict = median <= 0.05 and worst <= 0.15
        console.print(f"QLoRA on CUDA: median |error| {median:.2%}, worst {worst:.2%}: {verdict}")
    return verdict


def _timed_fit(overrides: list[str]) -> tuple[float, int, str, int, float | None]:
    """`python -m search.fit OVERRIDES` in a fresh process: seconds, peak host memory,
    what it printed, its exit status, and the seconds until its first table was printed
    (read as it streams: the report prints each table as soon as it is predicted)."""
    code = (
        "import resource, runpy, sys; sys.argv = ['search.fit', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('search.fit', run_name='__main__')\n"
        "finally:\n    print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    started = time.perf_counter()
    first_s = None
    with subprocess.Popen(
        [sys.executable, "-u", "-c", code, *overrides], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    ) as child:  # fmt: skip
        assert child.stdout is not None
        lines = []
        for line in child.stdout:
            lines.append(line)
            if first_s is None and line.startswith("fit report: table 1/"):
                first_s = time.perf_counter() - started
        returncode = child.wait(timeout=900)
    seconds = time.perf_counter() - started
    out = "".join(lines)
    rss = int(out.rsplit("maxrss", 1)[-1].split()[0]) * 1024 if "maxrss" in out else 0
    return seconds, rss, out, returncode, first_s


def _compare_fast_and_whole(console: Console, name: str, overrides: list[str]) -> bool:
    """The fast predictor against the whole one (every step computed on all layers) on
    the cells of data.seq_len=128, both checkpointing modes; prints a table."""
    table = Table(title=f"{name}: fast path against the full fake step (bytes)")
    columns = ("cell", "smallest limit", "whole", "live peak", "whole", "diff", "s fast/whole")
    for column in columns:
        table.add_column(column, justify="right")
    worst, compared = 0, 0
    cells = list(itertools.product(("fp32", "bf16"), (1, 2), (1, 2)))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for mode in ("none", "blocks"):
            layout = ["data.seq_len=128", f"trainer.activation_checkpointing={mode}"]
            cfg = compose(config_name="config", overrides=[*overrides, *layout])
            spec = plan(cfg, cfg.search.memory_budget)
            workload = Workloads().of(cfg)
            fast = workload.predictor(spec, cfg.optimizer)
            whole = workload.predictor(spec, cfg.optimizer, whole=True)
            for precision, batch, accum in cells:
                trainer = dataclasses.replace(
                    spec.trainer, batch_size=batch, accum_steps=accum, precision=precision,
                    effective_batch_size=None,
                )  # fmt: skip
                a = fast.predict(trainer, workload.num_train, spec.limit_bytes)
                b = whole.predict(trainer, workload.num_train, spec.limit_bytes)
                got = (a.peak_bytes, a.tensor_bytes, a.reserved_bytes or 0)
                expected = (b.peak_bytes, b.tensor_bytes, b.reserved_bytes or 0)
                diff = max(abs(x - y) for x, y in zip(got, expected, strict=True))
                worst, compared = max(worst, diff), compared + 1
                table.add_row(
                    f"{mode} {precision} {batch}x{accum}", str(a.peak_bytes), str(b.peak_bytes),
                    str(a.tensor_bytes), str(b.tensor_bytes), str(diff),
                    f"{a.seconds:.1f}/{b.seconds:.1f}",
                )  # fmt: skip
    console.print(table)
    console.print(f"{name}: {compared} cells compared, worst difference {worst} bytes")
    return worst == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", help="a folder of _dump_snapshot .json.gz files")
    parser.add_argument("--decoders", action="store_true", help="fit-report cost, 125M-8B")
    parser.add_argument(
        "--fit-reports", action="store_true", help="the 8B reports: time, host memory, exact"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--precisions", nargs="+", default=PRECISIONS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=BATCH_SIZES)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--max-run-s", type=float, default=20.0, help="skip longer real runs")
    parser.add_argument("--no-grid", action="store_true", help="only --traces / --decoders")
    parser.add_argument("--qlora", action="store_true", help="QLoRA steps, predicted and run")
    args = parser.parse_args()
    console = Console(width=160)
    verdicts = []
    if args.traces:
        verdicts.append(traces(console, args.traces))
    if args.decoders:
        verdicts.append(decoders(console))
    if args.fit_reports:
        verdicts.append(fit_reports(console))
    if args.qlora:
        verdicts.append(qlora(console, args.device))
    if not args.no_grid:
        verdicts.append(grid(console, args))
    sys.exit(0 if all(verdicts) else 1)


def grid(console: Console, args: argparse.Namespace) -> bool:
    """Each model x precision x batch size: predicted against a real run; True on PASS."""
    # Room for two full steps of the largest batch, so that the steady step exists.
    num_samples = int(2.2 * max(args.batch_sizes) / 0.98) + 8
    cuda = args.device == "cuda"
    rows, errors, skipped, unscaled, failed = [], [], [], [], []
    predict_s, step_s = [], []
    workloads = Workloads()  # each model's data and predictor, shared by its real runs
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for model in args.models:
            cfg = _config(model, args.device, args.image_size, num_samples)
            spec = plan(cfg, None)
            workload = workloads.of(cfg)
            num_train = workload.num_train
            predictor = workload.predictor(spec, cfg.optimizer)
            for precision in args.precisions:
                seconds_per_sample = None  # of the last measured run, to skip hopeless ones
                for batch_size in args.batch_sizes:
                    trainer = dataclasses.replace(
                        spec.trainer,
                        batch_size=batch_size,
                        precision=precision,
                        effective_batch_size=None,
                    )
                    cell = f"{model}/{precision}/{batch_size}"
                    try:
                        prediction = predictor.predict(trainer, num_train, spec.limit_bytes)
                    except Exception as error:  # this cell fails; the next ones still run
                        failed.append(_failure(cell, error))
                        continue
                    predict_s.append(prediction.seconds)
                    estimate = 3 * batch_size * seconds_per_sample if seconds_per_sample else 0
                    if estimate > args.max_run_s:
                        skipped.append(f"{cell} (~{estimate:.0f} s)")
                        continue
                    started = time.perf_counter()
                    try:
                        result = run(
                            cfg, dataclasses.replace(spec, trainer=trainer), None, workload
                        )
                    except Exception as error:
                        failed.append(_failure(cell, error))
                        release_memory(spec.device)
                        continue
                    elapsed = time.perf_counter() - started
                    seconds_per_sample = elapsed / (3 * batch_size)
                    step_s.append(result.step_ms / 1000)
                    measured = result.reserved_bytes if cuda else result.peak_bytes
                    if precision == "fp16" and result.peak_bytes < predictor.state_bytes:
                        # The GradScaler skipped the measured steps (inf gradients at its
                        # initial scale of 2**16), so no optimizer state exists yet; the
                        # prediction is of the steady state, once steps are taken.
                        unscaled.append(f"{model}/{precision}/{batch_size}")
                        continue
                    error = prediction.error(result)  # CUDA: the reserve under the limit
                    errors.append(error)
                    live_error = None
                    if cuda:
                        live_error = (
                            prediction.tensor_bytes - result.peak_bytes
                        ) / result.peak_bytes
                    rows.append(
                        (model, precision, batch_size, prediction, measured, error, live_error,
                         result.step_ms / 1000)
                    )  # fmt: skip
                    console.print(
                        f"{model:>9} {precision:>4} {batch_size:>4}: predicted "
                        f"{format_bytes(prediction.reserved_bytes or prediction.peak_bytes)}, "
                        "measured "
                        f"{format_bytes(measured)} ({error:+.2%}); "
                        f"{prediction.seconds:.2f} s to predict, "
                        f"{result.step_ms / 1000:.2f} s a step"
                    )
    passed = _report(console, args, rows, errors, skipped, predict_s, step_s, cuda)
    if failed:
        console.print(f"{len(failed)} cells failed ([bold]FAIL[/bold]): " + "; ".join(failed))
    if unscaled:
        console.print(
            f"{len(unscaled)} fp16 cells not compared: the GradScaler skipped the measured "
            "steps (inf gradients at the initial scale), so they ran without optimizer state: "
            + ", ".join(unscaled)
        )
    return passed and not failed


def _failure(cell: str, error: Exception) -> str:
    """A failed cell, its traceback printed: what the table's verdict lists."""
    traceback.print_exc()
    return f"{cell}: {type(error).__name__}: {error}"[:300]


def _report(console, args, rows, errors, skipped, predict_s, step_s, cuda) -> bool:  # noqa: ANN001
    what = "max_memory_reserved (CUDA)" if cuda else "tracked tensor peak (CPU)"
    table = Table(title=f"Predicted peak vs measured {what}, image {args.image_size}px")
    for column in ("model", "precision", "batch", "predicted", "measured", "error"):
        table.add_column(column, justify="right")
    if cuda:
        table.add_column("live tensors vs allocated", justify="right")
    table.add_column("predict s", justify="right")
    table.add_column("step s", justify="right")
    for model, precision, batch, prediction, measured, error, live, step in rows:
        predicted = prediction.reserved_bytes or prediction.peak_bytes  # CUDA: under the limit
        cells = [model, precision, str(batch), format_bytes(predicted),
                 format_bytes(measured), f"{error:+.2%}"]  # fmt: skip
        if cuda:
            cells.append(f"{live:+.2%}")
        table.add_row(*cells, f"{prediction.seconds:.2f}", f"{step:.2f}")
    console.print(table)
    if not errors:
        console.print("nothing measured")
        return False
    absolute = [abs(e) for e in errors]
    median, worst = statistics.median(absolute), max(absolute)
    if cuda:
        # Every cell fits the card (no budget is set): none may be under-predicted by more
        # than 2%, the side on which a "fits" runs out of memory.
        under = min(errors)
        verdict = "PASS" if median <= 0.05 and worst <= 0.15 and under >= -0.02 else "FAIL"
        target = f"median <= 5%, worst <= 15%, none under -2%: lowest {under:+.2%}"
    else:
        verdict = "PASS" if worst <= 0.01 else "FAIL"
        target = "every cell within 1%"
    console.print(
        f"{len(errors)} cells measured: median |error| {median:.3%}, worst {worst:.3%} "
        f"(target {target}): [bold]{verdict}[/bold]"
    )
    console.print(
        f"time per prediction: median {statistics.median(predict_s):.2f} s, max "
        f"{max(predict_s):.2f} s over {len(predict_s)} predictions; time per real step: median "
        f"{statistics.median(step_s):.2f} s, max {max(step_s):.2f} s"
    )
    if skipped:
        console.print(
            f"{len(skipped)} cells predicted but not run (real run over --max-run-s="
            f"{args.max_run_s:g}): " + ", ".join(skipped)
        )
    return verdict == "PASS"


if __name__ == "__main__":
    main()
