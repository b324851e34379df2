"""Every config option and every experiment composes, validates and instantiates; a user's
own model and dataset plug in from YAML through `_target_`, without touching the package."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from batchfit.common.checks import ConfigError
from batchfit.search.sampling.sampler import build_sampler
from batchfit.search.sampling.space import parse_space
from batchfit.search.study.validate import validate
from batchfit.tracking.metrics import VAL_LOSS
from batchfit.train.build import (
    build_data,
    build_model,
    build_optimizer,
    build_pipeline,
    build_scheduler,
    build_task,
)
from batchfit.train.data import Datasets, Splits, split
from batchfit.train.plan import plan
from batchfit.train.run import run
from batchfit.train.tasks import logits_of

CPU = torch.device("cpu")

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = sorted(
    # A nested group (search/sampler) is chosen by its path: search/sampler=grid.
    (path.parent.relative_to(CONF).as_posix(), path.stem)
    for group in GROUPS
    # composed below: experiments and budgets are deltas, architectures values of model.config
    if group not in ("experiment", "budget", "architecture")
    for path in (CONF / group).rglob("*.yaml")
)
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").rglob("*.yaml"))
BUDGETS = sorted(p.stem for p in (CONF / "budget").rglob("*.yaml"))
SMALL = ["data=synthetic", "data.num_samples=64", "data.image_size=8", "trainer.device=cpu"]


def test_the_globs_found_the_configs() -> None:
    assert {"model", "data", "optimizer", "scheduler", "trainer", "search"} <= set(GROUPS)
    assert len(OPTIONS) >= 12 and EXPERIMENTS and BUDGETS


# Data options that need the user's files: what the error names.
UNSET = {"cifar10": "data.root", "imagefolder": r"data.train.root is not set.*\n.*data.val.root"}
# Options that only make sense together: each is composed with its partners.
TEXT = ["data=python_stdlib", "data.max_bytes=20000", "data.seq_len=16", "task=language_model"]
PARTNERS = {("model", "gpt"): TEXT, ("data", "python_stdlib"): [*TEXT, "model=gpt"]}
PARTNERS[("task", "language_model")] = [*TEXT, "model=gpt"]
LLM = ["model=hf_causal_lm", "data=text", "data.max_bytes=20000", "data.seq_len=16"]
for _option in (("model", "hf_causal_lm"), ("data", "text"), ("task", "causal_lm")):
    PARTNERS[_option] = [*LLM, "task=causal_lm"]


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_instantiates(hydra_conf, group: str, option: str) -> None:
    overrides = [*SMALL, f"{group}={option}"] if group != "data" else [f"data={option}"]
    if (group, option) in PARTNERS:
        overrides = ["trainer.device=cpu", f"{group}={option}", *PARTNERS[(group, option)]]
    if option == "cifar10":
        overrides.append("data.download=false")
    cfg = hydra_conf(overrides)
    spec = plan(cfg, cfg.search.memory_budget)
    if option in UNSET:
        with pytest.raises(ConfigError, match=UNSET[option]):
            build_data(cfg)
        return
    data = build_data(cfg)
    assert isinstance(data, Splits | Datasets)
    pipeline = build_pipeline(cfg, CPU)
    assert pipeline.num_train > 0
    task = build_task(cfg)
    assert task.directions()[VAL_LOSS] == "minimize"
    if group == "task" and (group, option) not in PARTNERS:
        return  # regression: a task for data and a model of one's own (tests/train/)
    if group == "search/sampler":
        # The sampler it names, built as a study builds it (a grid from the space).
        space = parse_space({"trainer.batch_size": "choice(8, 16)"})
        sampler, _ = build_sampler(cfg.search.sampler, space)
        assert type(sampler).__name__.lower().startswith(option)
        return
    model = build_model(cfg, pipeline, task, spec.trainer.activation_checkpointing)
    optimizer = build_optimizer(cfg, model.parameters(), spec.lr)
    scheduler = build_scheduler(cfg, optimizer, total_steps=10)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert scheduler.get_last_lr()[0] > 0
    batch = pipeline.example(2)
    with torch.no_grad():
        output = task.forward(model, batch)
        assert torch.isfinite(task.loss(output, batch))
    if isinstance(data, Splits):
        assert output.shape == (2, data.num_classes)
    else:  # the byte-level LMs: a distribution over 256 bytes at every position
        assert logits_of(output).shape == (2, cfg.data.seq_len, 256)


@pytest.mark.parametrize("budget", BUDGETS)
def test_every_budget_preset_is_selected_by_its_model_and_data(hydra_conf, budget: str) -> None:
    model, data = budget.split("_", 1)
    cfg = hydra_conf([f"model={model}", f"data={data}"])
    assert cfg.search.memory_budget is not None
    assert hydra_conf(["model=mlp", f"data={data}"]).search.memory_budget is None


# Experiments planned for a real GPU's memory (the 8B fit report: search.gpu=H100-80GB).
WHOLE_DEVICE = {"llm_lora", "llm_qlora", "llm_full"}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(hydra_conf, experiment: str, tmp_path) -> None:
    overrides = [
        f"+experiment={experiment}",
        *(["data=digits"] if experiment.startswith("resnet") else []),  # CIFAR-10 is online
        f"search.storage=sqlite:///{tmp_path}/o.db",
    ]
    cfg = hydra_conf(overrides)
    checked = validate(cfg, experiment, lambda trial: hydra_conf([*overrides, *trial]))
    assert checked.space.distributions, "an experiment searches something"
    if experiment in WHOLE_DEVICE:  # the device's memory: a GPU's, or search.gpu's card
        assert checked.spec.budget_bytes is None and checked.spec.limit_bytes > 0
    else:  # a simulated device, so that some of the space does not fit on a CPU
        assert checked.spec.budget_bytes is not None


def test_resnet_experiment_on_missing_cifar_names_data_root(hydra_conf, tmp_path) -> None:
    cfg = hydra_conf(
        ["+experiment=resnet", f"data.root={tmp_path}/none", "data.download=false",
         f"search.storage=sqlite:///{tmp_path}/o.db"]
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"data.root=.*data=digits"):
        validate(cfg, "resnet-cifar10", hydra_conf)


# A user's own model and dataset, defined outside the package and selected from YAML.
def tiny_model(num_classes: int, in_channels: int, hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.LazyLinear(hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )


def tiny_data(num_samples: int, seed: int) -> Splits:
    gen = torch.Generator().manual_seed(seed)
    templates = 2 * torch.randn(3, 2, 4, 4, generator=gen)  # one pattern per class
    y = torch.randint(0, 3, (num_samples,), generator=gen)
    x = templates[y] + torch.randn(num_samples, 2, 4, 4, generator=gen)
    return split(x, y, val_fraction=0.25, seed=seed, num_classes=3)


def test_user_model_and_dataset_plug_in_from_yaml(hydra_conf, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text(f"_target_: {__name__}.tiny_model\nhidden: 8\n")
    (tmp_path / "data" / "mine.yaml").write_text(
        f"_target_: {__name__}.tiny_data\nnum_samples: 200\nseed: ${{seed}}\n"
    )
    cfg = hydra_conf(
        [
            f"hydra.searchpath=[file://{tmp_path}]",
            "model=mine",
            "data=mine",
            "trainer.device=cpu",
            "trainer.max_epochs=10",
            "optimizer.lr=0.2",
        ]
    )
    result = run(cfg, plan(cfg, None))
    assert result.val_acc > 0.6  # 3 well-separated classes; chance is 1/3
    assert result.peak_bytes > 0
