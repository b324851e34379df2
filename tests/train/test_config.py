"""TrainerConfig validation, and that conf/ composes into valid settings."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_method
from omegaconf import OmegaConf

from batchfit.common.checks import ConfigError, unknown_keys
from batchfit.train.config import DEVICES, LR_SCALING_RULES, TrainerConfig
from batchfit.train.device.sizes import parse_budget

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_defaults_are_valid():
    cfg = TrainerConfig()
    assert cfg.effective_batch_size == 32
    assert TrainerConfig(batch_size=16, accum_steps=4).effective_batch_size == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(batch_size=0), r"trainer\.batch_size must be an integer >= 1, got 0; "
                             r"override with trainer\.batch_size=1"),
        (dict(batch_size=-4), r"trainer\.batch_size .* got -4"),
        (dict(batch_size=2.5), r"trainer\.batch_size .* got 2\.5"),
        (dict(batch_size="32"), r"trainer\.batch_size .* got '32'"),
        (dict(batch_size=True), r"trainer\.batch_size .* got True"),
        (dict(accum_steps=0), r"trainer\.accum_steps must be an integer >= 1, got 0; "
                              r"override with trainer\.accum_steps=1"),
        (dict(log_every_steps=0), r"trainer\.log_every_steps .*trainer\.log_every_steps=1"),
        (dict(warmup_steps=-1), r"trainer\.warmup_steps must be an integer >= 0.*"
                                r"trainer\.warmup_steps=0"),
        (dict(lr_ref_batch_size=0), r"trainer\.lr_ref_batch_size .*lr_ref_batch_size=1"),
        (dict(max_epochs=0), r"trainer\.max_epochs must be an integer >= 1.*max_epochs=1"),
        (dict(max_steps=0), r"trainer\.max_steps must be an integer >= 1.*max_steps=1"),
        (dict(val_every_steps=0), r"trainer\.val_every_steps .*val_every_steps=1"),
        (dict(precision="fp8"), r"trainer\.precision must be one of fp32, tf32, bf16, fp16, "
                                r"got 'fp8'; override with trainer\.precision=bf16"),
        (dict(lr_scaling="cubic"), r"trainer\.lr_scaling must be one of auto, none, linear, sqrt, "
                                   r"got 'cubic'; override with trainer\.lr_scaling=linear"),
        (dict(device="tpu"), r"trainer\.device must be one of auto, cpu, cuda, got 'tpu'; "
                             r"override with trainer\.device=auto"),
        (dict(grad_clip_norm=0.0), r"trainer\.grad_clip_norm must be > 0 or null.*"
                                   r"trainer\.grad_clip_norm=1\.0"),
        (dict(grad_clip_norm=-1), r"trainer\.grad_clip_norm must be > 0"),
        (dict(grad_clip_norm=float("nan")), r"trainer\.grad_clip_norm must be > 0"),
        (dict(max_epochs=None, max_steps=None),
         r"trainer\.max_epochs and trainer\.max_steps are both null.*"
         r"override with trainer\.max_epochs=3"),
    ],
)  # fmt: skip
def test_each_bad_value_names_its_key_and_fix(kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        TrainerConfig(**kwargs)
    assert len(info.value.problems) == 1
    assert isinstance(info.value, ValueError)  # callers catching ValueError still see it


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_epochs=None, max_steps=5),
        dict(max_epochs=2, max_steps=None),
        dict(max_epochs=2, max_steps=5, val_every_steps=3),
        dict(warmup_steps=0, grad_clip_norm=0.5),
        dict(precision="tf32", lr_scaling="sqrt", device="cpu"),
        dict(grad_clip_norm=1),  # an int is a fine norm
    ],
)
def test_valid_combinations(kwargs):
    cfg = TrainerConfig(**kwargs)  # accepted: no ConfigError
    # What follows from them: the effective batch, and the same config back from its fields.
    assert cfg.effective_batch_size == cfg.batch_size * cfg.accum_steps
    assert TrainerConfig(**dataclasses.asdict(cfg)) == cfg


def test_several_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        TrainerConfig(batch_size=0, accum_steps=0, precision="fp8", lr_scaling="cubic",
                      max_epochs=None, max_steps=None)  # fmt: skip
    problems = info.value.problems
    assert len(problems) == 5
    for key in ("batch_size", "accum_steps", "precision", "lr_scaling", "max_steps"):
        assert any(f"trainer.{key}" in p for p in problems), key
    # The message lists every problem, one per line.
    message = str(info.value)
    assert message.splitlines() == [f"- {p}" for p in problems]


def test_from_mapping():
    cfg = TrainerConfig.from_mapping({"batch_size": 8, "accum_steps": 2, "precision": "bf16"})
    assert cfg == TrainerConfig(batch_size=8, accum_steps=2, precision="bf16")
    assert TrainerConfig.from_mapping({}) == TrainerConfig()


def test_from_mapping_rejects_unknown_keys():
    with pytest.raises(
        ConfigError,
        match=r"trainer\.batchsize is not a trainer setting; known: accum_steps, "
        r"activation_checkpointing, batch_size, device",
    ) as info:
        TrainerConfig.from_mapping({"batchsize": 8, "lr": 0.1})
    assert [p.split(" ")[0] for p in info.value.problems] == ["trainer.batchsize", "trainer.lr"]


def test_from_mapping_validates_values():
    with pytest.raises(ConfigError, match=r"trainer\.batch_size"):
        TrainerConfig.from_mapping({"batch_size": 0})


def test_non_numeric_grad_clip_norm_is_a_config_error():
    with pytest.raises(ConfigError, match=r"trainer\.grad_clip_norm"):
        TrainerConfig(grad_clip_norm="abc")


def test_every_rule_and_device_is_accepted_and_unknown_ones_are_refused_with_the_list():
    for rule in LR_SCALING_RULES:
        assert TrainerConfig(lr_scaling=rule).lr_scaling == rule
    for device in DEVICES:
        assert TrainerConfig(device=device).device == device
    with pytest.raises(
        ConfigError, match=r"lr_scaling must be one of auto, none, linear, sqrt, got"
    ):
        TrainerConfig(lr_scaling="cubic")
    with pytest.raises(ConfigError, match=r"device must be one of auto, cpu, cuda, got 'tpu'"):
        TrainerConfig(device="tpu")


# --------------------------------------------------------------------------- conf/


@pytest.fixture(scope="module")
def composer():
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        yield lambda *overrides: compose("config", overrides=list(overrides))


def _trainer(cfg) -> TrainerConfig:
    return TrainerConfig.from_mapping(OmegaConf.to_container(cfg.trainer, resolve=True))


def test_trainer_yaml_matches_the_dataclass_defaults(composer):
    # conf/trainer/default.yaml lists exactly TrainerConfig's fields, with the same defaults.
    cfg = composer()
    assert set(cfg.trainer) == {f.name for f in dataclasses.fields(TrainerConfig)}
    assert _trainer(cfg) == TrainerConfig(seed=cfg.seed)


def test_command_line_overrides_are_validated(composer):
    cfg = composer("trainer.batch_size=0", "trainer.precision=fp8")
    with pytest.raises(ConfigError) as info:
        _trainer(cfg)
    assert len(info.value.problems) == 2


def test_budget_groups(composer):
    # The optional budget@search group follows ${model}_${data}; none for the default pair.
    assert composer().search.memory_budget is None
    budgets = {
        ("resnet18", "digits"): 160 * 2**20,
        ("resnet18", "cifar10"): 2**30,
        ("resnet18", "synthetic"): 2**30,
        ("small_cnn", "cifar10"): None,
    }
    for (model, data), expected in budgets.items():
        cfg = composer(f"model={model}", f"data={data}")
        assert parse_budget(cfg.search.memory_budget, 64 * 2**30) == expected, (model, data)
    # A command-line override still wins.
    cfg = composer("model=resnet18", "data=digits", "search.memory_budget=90%")
    assert cfg.search.memory_budget == "90%"


def test_resnet_experiment_composes(composer):
    cfg = composer("+experiment=resnet")
    trainer = _trainer(cfg)
    assert trainer.max_epochs == 1  # a quick start: one epoch a trial
    assert (trainer.lr_scaling, trainer.lr_ref_batch_size) == ("linear", 128)
    assert cfg.model._target_ == "batchfit.train.models.resnet18"
    assert cfg.data._target_ == "batchfit.train.data.cifar10"
    assert parse_budget(cfg.search.memory_budget, 64 * 2**30) == 2**30
    offline = composer("+experiment=resnet", "data=digits")
    assert parse_budget(offline.search.memory_budget, 64 * 2**30) == 160 * 2**20
    # Every searched trainer value is one TrainerConfig accepts.
    for precision in ("fp32", "tf32", "bf16", "fp16"):
        assert dataclasses.replace(trainer, precision=precision).precision == precision


@pytest.mark.parametrize(
    ("group", "option"),
    [
        (group.name, path.stem)
        for group in sorted(CONF.iterdir())
        if group.name in ("model", "data", "optimizer", "scheduler")
        for path in sorted(group.glob("*.yaml"))
    ],
)
def test_group_keys_match_their_targets(composer, group, option):
    # Every key of a _target_ config is a parameter of the function or class it builds.
    cfg = composer(f"{group}={option}")
    node = OmegaConf.to_container(cfg[group], resolve=True)
    target = get_method(node.pop("_target_"))
    node.pop("_partial_", None)
    parameters = inspect.signature(target).parameters
    unknown = set(node) - set(parameters)
    assert not unknown, f"conf/{group}/{option}.yaml: {sorted(unknown)} not in {target}"


def test_unknown_keys_lists_the_known_and_names_the_closest():
    assert unknown_keys("loader", ["num_worker", "num_workers", "zzz"], ["num_workers", "x"]) == [
        "loader.num_worker is not a loader setting; known: num_workers, x; did you mean "
        "loader.num_workers?",
        "loader.zzz is not a loader setting; known: num_workers, x",
    ]
    (problem,) = unknown_keys("mlflow", ["tracking_url"], ["tracking_uri"], "an mlflow setting")
    assert problem.startswith("mlflow.tracking_url is not an mlflow setting; known:")
