"""The tools users reach for today, run for real, against batchfit's integrations: the same
model both ways, under one device-memory budget enforced on the CPU.

    python bench/versus_finders.py           # 6 training steps after the choice
    python bench/versus_finders.py --quick   # 2 (what tests/bench/test_versus_finders.py runs)

- **Lightning**: the Classifier of docs/python.md asking for 256 samples a step
  (batch_size=256, accumulate_grad_batches=1), trained with Lightning's own `BatchSizeFinder`
  (mode "power", 3 steps per trial from a batch of 2, as its defaults), then with batchfit's
  `PredictedBatchSize`.
- **Hugging Face Trainer**: the tiny Llama of docs/python.md asking for 16 samples a step
  (per_device_train_batch_size=16), trained with `auto_find_batch_size=True` (accelerate's
  `find_executable_batch_size`: x0.9 after each OOM), then with batchfit's `fit_arguments`.

The budget is enforced as a GPU enforces it: every tensor allocated while the run is alive
counts (the batches the data loader makes, the optimizer's state, activations; parameters and
buffers from the start), and within a training step (from a forward pass of the model to the
end of the optimizer step after it) an allocation past it raises
`torch.OutOfMemoryError("CUDA out of memory. ...")`, which both tools catch as the OOM they
search with. Outside the steps (data loaders, samplers, checkpoints: the host's, on a GPU
machine) nothing is refused. An op that allocates nothing is never refused (an OOM's
traceback keeps the failed step's tensors alive while the tools handle it). Per
tool: OOMs hit, forward passes spent before training at the size chosen, the micro-batch and
accumulation it trains with, the effective batch against the one asked for, and whether the
run then trained its steps within the budget. Verdict (exit status 0 PASS, 1 FAIL): batchfit
hits no OOM, spends no forward pass choosing, keeps the effective batch asked for, and its
runs train within the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch._subclasses.fake_tensor import FakeTensor

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.train.device.sizes import parse_budget  # noqa: E402
from batchfit.train.measure.memory import TensorMemoryTracker  # noqa: E402

LIGHTNING_BUDGET = "1MiB"
HF_BUDGET = "3MiB"


class Budget(TensorMemoryTracker):
    """Live tensor bytes held to `limit_bytes`, as a GPU holds them: an op whose outputs pass
    it raises torch.OutOfMemoryError, its message CUDA's."""

    def __init__(self, limit_bytes: int):
        super().__init__()
        self.limit_bytes, self.ooms, self.armed = limit_bytes, 0, True

    def _track(self, tensor: torch.Tensor, count: bool) -> None:
        # batchfit's prediction runs on fake tensors (their storage on the meta device):
        # nothing a GPU would hold
        if isinstance(tensor, FakeTensor) or tensor.device.type == "meta":
            return
        super()._track(tensor, count)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        before = self.live_bytes
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # an allocation past the limit fails, as cudaMalloc's; an op that allocates nothing
        # does not (the tensors an OOM's traceback holds are still alive in its handler)
        if self.armed and self.live_bytes > max(self.limit_bytes, before):
            self.ooms += 1
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate past {self.limit_bytes} bytes "
                f"(live {self.live_bytes}; the budget, enforced on the CPU)"
            )
        return out


@dataclass
class Outcome:
    tool: str
    ooms: int
    forwards_choosing: int  # forward passes before training at the chosen size began
    batch_size: int
    accum_steps: int
    asked: int  # samples per step asked for
    trained: bool  # its steps ran within the budget after the choice
    peak_bytes: int

    @property
    def effective(self) -> int:
        return self.batch_size * self.accum_steps


def _first_input(args: tuple, kwargs: dict) -> Any:
    """A forward pass's first input: positional (the classifier's) or keyword (the LM's)."""
    return args[0] if args else next(iter(kwargs.values()))


@contextlib.contextmanager
def counting_forwards(module: torch.nn.Module) -> Iterator[list[int]]:
    """[forward passes, the last one's batch size] while inside."""
    seen = [0, 0]

    def count(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        first = _first_input(args, kwargs)
        if not isinstance(first, FakeTensor):  # a prediction runs the copy, hooks and all
            seen[:] = [seen[0] + 1, first.shape[0]]

    handle = module.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


@contextlib.contextmanager
def armed_in_steps(model: torch.nn.Module, budget: Budget) -> Iterator[None]:
    """The budget armed from a real forward pass of `model` to the end of the optimizer
    step after it (AdamW's; Lightning runs forward and backward in the step's closure),
    where a GPU run allocates on the device; the data loaders, samplers and checkpoints
    in between are the host's, and the finder's own bookkeeping too."""
    budget.armed = False
    step = torch.optim.AdamW.step

    def arm(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not isinstance(_first_input(args, kwargs), FakeTensor):
            budget.armed = True

    def stepped(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        try:
            return step(self, *args, **kwargs)
        finally:
            budget.armed = False

    handle = model.register_forward_pre_hook(arm, with_kwargs=True)
    torch.optim.AdamW.step = stepped
    try:
        yield
    finally:
        torch.optim.AdamW.step = step
        handle.remove()


def _guide() -> dict[str, Any]:
    """docs/python.md's Classifier, its data set made at construction."""
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Classifier(pl.LightningModule):
        def __init__(self, batch_size: int = 256):
            super().__init__()
            self.batch_size = batch_size
            self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
            # the data set lives on the host: made before the budget counts (the batches
            # its loader makes count, as the copies a GPU run makes of them)
            self.data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):  # noqa: ANN201
            return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    return {"Classifier": Classifier}


def lightning_run(use_batchfit: bool, steps: int, root: Path) -> Outcome:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BatchSizeFinder

    from batchfit.lightning import PredictedBatchSize

    torch.manual_seed(0)
    module = _guide()["Classifier"]()
    budget = Budget(parse_budget(LIGHTNING_BUDGET, 0))
    budget.register([*module.parameters(), *module.buffers()])
    chooser = PredictedBatchSize(budget=LIGHTNING_BUDGET) if use_batchfit else BatchSizeFinder()
    choosing: list[int] = []

    class Mark(pl.Callback):  # the forward passes before training proper
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            choosing.append(forwards[0])

    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, callbacks=[Mark(), chooser], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(root),
    )  # fmt: skip
    trained = True
    with counting_forwards(module.net) as forwards, armed_in_steps(module.net, budget), budget:
        try:
            trainer.fit(module)
        except torch.OutOfMemoryError:
            trained = False
    name = "batchfit PredictedBatchSize" if use_batchfit else "Lightning BatchSizeFinder"
    return Outcome(
        name, budget.ooms, choosing[0] if choosing else forwards[0], module.batch_size,
        trainer.accumulate_grad_batches,
        256, trained and trainer.global_step == steps, budget.peak_bytes,
    )  # fmt: skip


def hf_run(use_batchfit: bool, steps: int, root: Path) -> Outcome:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from batchfit.hf import fit_arguments

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    tiny = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    lm = LlamaForCausalLM(tiny)
    rows = torch.randint(0, 256, (64, 32))
    train = [{"input_ids": row, "labels": row.clone()} for row in rows]
    args = TrainingArguments(
        output_dir=str(root / "hf"), per_device_train_batch_size=16,
        gradient_accumulation_steps=1, max_steps=steps, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True, auto_find_batch_size=not use_batchfit,
    )  # fmt: skip
    if use_batchfit:
        args = fit_arguments(lm, args, train, budget=HF_BUDGET).args
    budget = Budget(parse_budget(HF_BUDGET, 0))
    budget.register([*lm.parameters(), *lm.buffers()])
    trainer = Trainer(lm, args, train_dataset=train)
    trained = True
    with counting_forwards(lm) as forwards, armed_in_steps(lm, budget), budget:
        try:
            trainer.train()
        except torch.OutOfMemoryError:
            trained = False
        except RuntimeError as error:  # accelerate's "No executable batch size found"
            if "batch size" not in str(error):
                raise
            trained = False
    batch = forwards[1]  # the micro-batch it trained with last, after its search
    accum = trainer.args.gradient_accumulation_steps
    choosing = max(0, forwards[0] - steps * accum)  # the passes of the runs an OOM ended
    name = "batchfit fit_arguments" if use_batchfit else "Trainer auto_find_batch_size"
    done = trained and trainer.state.global_step == steps
    return Outcome(name, budget.ooms, choosing, batch, accum, 16, done, budget.peak_bytes)


def table(outcomes: list[Outcome]) -> Table:
    shown = Table(title="The same model, the same budget: the tool of the field against batchfit")
    for column in ("tool", "OOMs hit", "forward passes choosing", "trains with",
                   "effective batch (asked)", "trained in budget", "peak"):  # fmt: skip
        shown.add_column(column, justify="left" if column == "tool" else "right")
    for o in outcomes:
        shown.add_row(
            o.tool, str(o.ooms), str(o.forwards_choosing), f"{o.batch_size} x {o.accum_steps}",
            f"{o.effective} ({o.asked})", "yes" if o.trained else "no", f"{o.peak_bytes:,}",
        )  # fmt: skip
    return shown


def verdict(outcomes: list[Outcome]) -> list[str]:
    """What batchfit's runs fail of the claims; empty: PASS."""
    failed = []
    for o in outcomes:
        if not o.tool.startswith("batchfit"):
            continue
        if o.ooms or o.forwards_choosing:
            failed.append(f"{o.tool}: {o.ooms} OOM(s), {o.forwards_choosing} passes choosing")
        if o.effective != o.asked:
            failed.append(f"{o.tool}: effective batch {o.effective}, asked {o.asked}")
        if not o.trained:
            failed.append(f"{o.tool}: did not train its steps within the budget")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 steps after the choice, not 6")
    options = parser.parse_args(argv)
    steps = 2 if options.quick else 6
    warnings.filterwarnings("ignore")
    console = Console(width=160)
    runs: list[Callable[[bool, int, Path], Outcome]] = [lightning_run, hf_run]
    with tempfile.TemporaryDirectory() as root:
        outcomes = [run(ours, steps, Path(root)) for run in runs for ours in (False, True)]
    console.print(table(outcomes))
    failed = verdict(outcomes)
    for line in failed:
        console.print(f"FAIL {line}")
    console.print("PASS" if not failed else "FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
