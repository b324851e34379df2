"""What the 4-bit lever trades: memory against speed and, slightly, loss (QLoRA: Dettmers et
al. 2023, arXiv 2305.14314, whose NF4 matched 16-bit LoRA's quality on its benchmarks).

Two parts, each printed side by side:

1. Measured on this machine: the bundled tiny Llama (`+experiment=llm_qlora`'s model and
   data) trained with LoRA over fp32 weights and over NF4 weights, the same seed, steps and
   batches, rounds alternating so that both see the same machine; tokens/s (median of the
   rounds), the peak of live tensors, and the val loss reached.
2. Predicted for a GPU this machine does not have: Llama-3-8B with LoRA over bf16 weights
   against NF4 (double quantization), batch 1 x 2048 tokens, checkpointing, bf16, on an
   RTX 4090: the weights' bytes and the step's peak.

    python bench/quantization.py                 # 3 rounds, 60 steps each
    python bench/quantization.py --rounds 5 --steps 100

The verdict (exit status 1 when it fails): NF4's linear layers take under 30% of fp32's
bytes (4.13 bits against 32), the 8B step's predicted peak is lower in NF4 than in bf16,
and NF4's val loss is within 5% of fp32's. Speed is printed, not judged: it depends on
the CPU and on bitsandbytes' kernels for it (each 4-bit matmul dequantizes its weight
first), and on a GPU on bitsandbytes' CUDA kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.tracking.metrics import VAL_LOSS  # noqa: E402
from batchfit.train.language.quantize import quant_state_tensors  # noqa: E402
from batchfit.train.plan import plan  # noqa: E402
from batchfit.train.run import run  # noqa: E402
from batchfit.train.workload import Workloads  # noqa: E402

GiB, MiB = 2**30, 2**20
VARIANTS = {"fp32 weights": "model.quantization=none", "nf4 weights": "model.quantization=nf4"}


def _cfg(overrides: list[str]):  # noqa: ANN202
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def measured(rounds: int, steps: int, tmp: str) -> dict[str, dict]:
    """Each variant trained `rounds` times, alternating."""
    common = [
        "+experiment=llm_qlora", "trainer.batch_size=4", "data.seq_len=256",
        f"trainer.max_steps={steps}", "trainer.max_epochs=null", "trainer.precision=fp32",
        "optimizer.lr=0.003", "trainer.log_every_steps=1000",
        f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db", f"mlflow.artifact_root={tmp}/art",
    ]  # fmt: skip
    results: dict[str, dict] = {name: {"rates": []} for name in VARIANTS}
    for _ in range(rounds):
        for name, override in VARIANTS.items():
            cfg = _cfg([*common, override])
            spec = plan(cfg, None)
            workload = Workloads().of(cfg)
            result = run(cfg, spec, workload=workload)
            entry = results[name]
            entry["rates"].append(result.timed_units / result.timed_seconds)
            entry["peak"] = result.peak_bytes
            entry["val_loss"] = result.val[VAL_LOSS]
    return results


def linear_bytes(quantization: str) -> int:
    """The bytes of the tiny Llama's linear layers but the head, as built (fp32 weights,
    or packed 4-bit values and their scales)."""
    from batchfit.train.language.hf import causal_lm

    model = causal_lm(
        config="llama3_tiny", lora={"r": 8}, vocab_size=256, quantization=quantization
    )
    total = sum(t.untyped_storage().nbytes() for t in quant_state_tensors(model))
    for name, param in model.named_parameters():
        if "proj" in name and "lora_" not in name:  # q_proj ... down_proj: the base's
            total += param.untyped_storage().nbytes()
    return total


def predicted_8b() -> dict[str, tuple[int, int]]:
    """(state bytes, peak) of Llama-3-8B's step on an RTX 4090, bf16 weights against NF4."""
    out = {}
    for name, quantization in (("bf16 weights", "none"), ("nf4 weights", "nf4")):
        cfg = _cfg([
            "+experiment=llm_qlora", "model.config=llama3_8b", "model.dtype=bfloat16",
            f"model.quantization={quantization}", "search.gpu=RTX-4090",
            "trainer.batch_size=1", "data.seq_len=2048", "trainer.precision=bf16",
            "trainer.activation_checkpointing=blocks", "data.max_bytes=40000",
        ])  # fmt: skip
        spec = plan(cfg, None)
        workload = Workloads().of(cfg)
        predictor = workload.predictor(spec, cfg.optimizer)
        trainer = dataclasses.replace(spec.trainer, effective_batch_size=None)
        prediction = predictor.predict(trainer, workload.num_train, spec.limit_bytes)
        out[name] = (predictor.state_bytes, prediction.peak_bytes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    console = Console(width=160)
    with tempfile.TemporaryDirectory() as tmp:
        results = measured(args.rounds, args.steps, tmp)
    sizes = {name: linear_bytes(o.split("=")[1]) for name, o in VARIANTS.items()}
    table = Table(title=f"Tiny Llama, LoRA r=8, 4 x 256 tokens, {args.steps} steps, measured")
    for column in ("weights", "linear layers", "peak (live tensors)", "tokens/s", "val loss"):
        table.add_column(column, justify="right")
    for name, entry in results.items():
        rate = statistics.median(entry["rates"])
        table.add_row(
            name, f"{sizes[name] / 1024:.1f} KiB", f"{entry['peak'] / MiB:.2f} MiB",
            f"{rate:,.0f} ({', '.join(f'{r:,.0f}' for r in entry['rates'])})",
            f"{entry['val_loss']:.4f}",
        )  # fmt: skip
    console.print(table)
    base, nf4 = results["fp32 weights"], results["nf4 weights"]
    speed = statistics.median(nf4["rates"]) / statistics.median(base["rates"])
    size_ratio = sizes["nf4 weights"] / sizes["fp32 weights"]
    loss_gap = (nf4["val_loss"] - base["val_loss"]) / base["val_loss"]
    console.print(
        f"nf4 / fp32: linear layers x{size_ratio:.3f}, peak x{nf4['peak'] / base['peak']:.3f}, "
        f"tokens/s x{speed:.2f}, val loss {loss_gap:+.2%}"
    )
    big = predicted_8b()
    table = Table(title="Llama-3-8B, LoRA r=8, 1 x 2048 tokens, bf16, checkpointing, RTX-4090")
    for column in ("weights", "state (weights, adapters, moments)", "predicted peak"):
        table.add_column(column, justify="right")
    for name, (state, peak) in big.items():
        table.add_row(name, f"{state / GiB:.2f} GiB", f"{peak / GiB:.2f} GiB")
    console.print(table)
    (bf16_state, bf16_peak), (nf4_state, nf4_peak) = big["bf16 weights"], big["nf4 weights"]
    console.print(
        f"nf4 / bf16: state x{nf4_state / bf16_state:.3f}, peak x{nf4_peak / bf16_peak:.3f} "
        f"({(bf16_peak - nf4_peak) / GiB:.1f} GiB less)"
    )
    checks = {
        "linear layers under 30% of fp32's": size_ratio < 0.30,
        "8B peak lower in nf4": nf4_peak < bf16_peak,
        "val loss within 5% of fp32's": abs(loss_gap) <= 0.05,
    }
    for check, ok in checks.items():
        console.print(f"  {'ok ' if ok else 'FAIL'} {check}")
    console.print("verdict: " + ("PASS" if all(checks.values()) else "FAIL"))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
