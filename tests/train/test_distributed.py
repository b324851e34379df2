"""Data-parallel runs on CPU: 2 gloo ranks launched by torch's elastic launcher
(train/launch/distributed.py) against one process, and one rank's predicted memory against what
each rank measured."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from batchfit.common.checks import ConfigError
from batchfit.train.config import TrainerConfig
from batchfit.train.measure.memory import OutOfMemory
from batchfit.train.plan import plan
from batchfit.train.run import run
from batchfit.train.step import Hooks, RunResult
from batchfit.train.workload import Workloads

# 90 synthetic 1x8x8 images, 72 to train: with a global batch of 32 an epoch is steps of 32,
# 32 and 8; the last one's second global micro-batch (16 samples) is rank 0's alone, and
# rank 1 trains on padding there. Two epochs: six steps, two of them short.
DATA = [
    "data=synthetic",
    "data.num_samples=90",
    "data.channels=1",
    "data.image_size=8",
    "model=mlp",
    "model.hidden=32",
    "trainer.max_epochs=2",
    "trainer.log_every_steps=2",
    "optimizer.lr=0.1",
]


def _trained(
    hydra_conf: Callable[..., DictConfig], overrides: list[str]
) -> tuple[RunResult, nn.Module, DictConfig]:
    cfg = hydra_conf([*DATA, *overrides])
    spec = plan(cfg, OmegaConf.select(cfg, "search.memory_budget"))
    models: list[nn.Module] = []
    result = run(cfg, spec, Hooks(on_end=models.append))
    return result, models[0], cfg


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_two_ranks_train_as_one_process_and_each_rank_is_predicted_to_the_byte(
    hydra_conf: Callable[..., DictConfig],
) -> None:
    """DDP with 2 ranks x batch 8 x accumulation 2 ends with the parameters of one process
    training batch 16 x 2 (the same global batch of 32, ragged and padded last steps
    included), and FSDP2 with those of DDP; validation sees the whole split once."""
    one, one_model, _ = _trained(hydra_conf, ["trainer.batch_size=16", "trainer.accum_steps=2"])
    layouts = {}
    for strategy in ("ddp", "fsdp"):
        layouts[strategy] = _trained(
            hydra_conf,
            [
                f"trainer.strategy={strategy}",
                "trainer.devices=2",
                "trainer.batch_size=8",
                "trainer.accum_steps=2",
            ],
        )
    before = _params(one_model)
    assert any(
        (p - q).abs().max() > 1e-3
        for p, q in zip(before.values(), _params(_untrained(hydra_conf)).values(), strict=True)
    ), "the run trained"
    for strategy, (result, model, cfg) in layouts.items():
        for name, value in _params(model).items():
            torch.testing.assert_close(value, before[name], rtol=1e-5, atol=1e-6, msg=strategy)
        assert result.num_steps == one.num_steps == 6
        assert result.num_samples == one.num_samples == 2 * 72  # both ranks', padding not
        assert result.val == pytest.approx(one.val, rel=1e-5), strategy
        assert len(result.evals) == len(one.evals) == 2  # once per epoch, not once per rank
        # Each rank measured its own peak; the run's is the larger; the predictor's one rank
        # (rank 0 of a fake process group) is the same to the byte.
        assert len(result.rank_peak_bytes) == 2
        assert result.peak_bytes == max(result.rank_peak_bytes)
        spec = plan(cfg, None)
        predicted = Workloads().of(cfg).predict(spec, cfg.optimizer).peak_bytes
        assert result.rank_peak_bytes == [predicted, predicted], strategy
        assert result.metrics()["memory/rank_1/peak_bytes"] == predicted
        assert result.throughput_samples_per_sec > 0
    # Each DDP rank holds its gradient buckets beside one process's step at a per-device
    # batch of 8; FSDP2 shards parameters, gradients and momentum: less than DDP.
    ddp, fsdp = layouts["ddp"][0], layouts["fsdp"][0]
    assert fsdp.peak_bytes < ddp.peak_bytes
    # The gradient noise scale (train/measure/noise.py): FSDP2 reduce-scatters each micro-batch, so
    # its first micro-batch is the 16 samples one process's is, and the sums of squares of
    # the two ranks' shards add up to one process's estimate. A DDP rank's first micro-batch
    # is its own 8 samples before the all-reduce.
    assert one.noise_estimator.startswith("accumulation:")
    assert fsdp.noise_estimator.startswith("ranks:")
    assert ddp.noise_estimator.startswith("ranks:")
    assert one.noise is not None and fsdp.noise is not None and ddp.noise is not None
    assert fsdp.noise.steps == one.noise.steps == 2  # full steps past the measured ones
    assert fsdp.noise.grad_sq_norm == pytest.approx(one.noise.grad_sq_norm, rel=1e-4)
    assert fsdp.noise.grad_variance == pytest.approx(one.noise.grad_variance, rel=1e-4)
    assert ddp.noise.steps == 1  # DDP measures memory a step later: step 4 only
    assert ddp.noise.grad_variance > 0


def _untrained(hydra_conf: Callable[..., DictConfig]) -> nn.Module:
    from batchfit.train.build import build_model

    cfg = hydra_conf(DATA)
    workload = Workloads().of(cfg)
    torch.manual_seed(0)
    return build_model(cfg, workload.pipeline(torch.device("cpu")), workload.task, "none")


class Lopsided(nn.Module):
    """An MLP whose rank 1 (of a real process group) holds `ballast` floats per sample
    during its forward, at micro-batches of `from_batch` samples or more: a rank that
    needs more memory than the others (the one the predictor sees)."""

    def __init__(
        self, num_classes: int = 10, in_channels: int = 1, ballast: int = 0, from_batch: int = 1
    ):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 64, 32), nn.ReLU())
        self.head = nn.Linear(32, num_classes)
        self.ballast, self.from_batch = ballast, from_batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x)
        real = dist.is_initialized() and dist.get_backend() != "fake"
        if real and dist.get_rank() == 1 and x.shape[0] >= self.from_batch:
            h = h + torch.zeros(x.shape[0], self.ballast).sum() * 0
        return self.head(h)


LOPSIDED = ["model._target_=tests.train.test_distributed.Lopsided", "~model.hidden", "~model.depth"]


def test_one_rank_over_its_budget_is_an_oom_of_the_run_on_every_rank(
    hydra_conf: Callable[..., DictConfig],
) -> None:
    """Rank 1 needs 256 KiB more than rank 0 (the one the predictor sees): with a per-rank
    budget between the two, the ranks agree at the memory check and the run raises
    OutOfMemory naming rank 1, with its peak."""
    base = [*LOPSIDED, "trainer.strategy=ddp", "trainer.devices=2", "trainer.batch_size=8"]
    cfg = hydra_conf([*DATA, *base, "+model.ballast=8192"])
    predicted = Workloads().of(cfg).predict(plan(cfg, None), cfg.optimizer).peak_bytes
    budget = predicted + 2**17  # rank 0 fits; rank 1's 8 x 8192 floats do not
    with pytest.raises(OutOfMemory) as raised:
        _trained(hydra_conf, [*base, "+model.ballast=8192", f"+search.memory_budget={budget}"])
    assert raised.value.rank == 1
    assert raised.value.peak_bytes > budget >= predicted
    assert "rank 1 of 2" in str(raised.value) and "per rank" in str(raised.value)
    # Without a budget it trains: the ranks' peaks differ, the run's is the larger.
    result, _, _ = _trained(hydra_conf, [*base, "+model.ballast=8192"])
    rank_0, rank_1 = result.rank_peak_bytes
    assert rank_0 == predicted < rank_1 == result.peak_bytes
    assert result.metrics()["memory/rank_1/peak_bytes"] == rank_1


def test_the_global_batch_sets_the_learning_rate_and_bad_layouts_are_refused(
    hydra_conf: Callable[..., DictConfig],
) -> None:
    cfg = hydra_conf(
        [*DATA, "trainer.strategy=fsdp", "trainer.devices=4", "trainer.batch_size=8",
         "trainer.accum_steps=2", "trainer.lr_scaling=linear", "trainer.lr_ref_batch_size=32"]
    )  # fmt: skip
    spec = plan(cfg, None)
    assert spec.trainer.global_batch_size == 64
    assert spec.lr == pytest.approx(0.2)  # 0.1 at 32 samples per step, linear to 64
    assert spec.params()["global_batch_size"] == 64
    assert spec.params()["trainer.strategy"] == "fsdp"
    with pytest.raises(ConfigError) as error:
        TrainerConfig(devices=2)
    assert "trainer.strategy=ddp" in str(error.value)
    with pytest.raises(ConfigError) as error:
        TrainerConfig(strategy="fsdp", devices=2, precision="fp16")
    assert "trainer.precision=bf16" in str(error.value)
    with pytest.raises(ConfigError) as error:
        TrainerConfig(strategy="fsdp", devices=2, fsdp={"sharding": "layers", "reshard": True})
    problems = str(error.value)
    assert "trainer.fsdp.sharding" in problems and "trainer.fsdp.reshard is not" in problems


def test_two_ranks_on_one_cpu_package_count_its_joules_once(
    hydra_conf: Callable[..., DictConfig], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ranks read the host's one RAPL package (a powercap tree a test thread advances)
    over their own timed windows: the run's joules are that counter's, once, not the sum of
    the two ranks' readings of it."""
    from tests.search.test_energy_study import PackageCounter

    monkeypatch.setenv("BATCHFIT_POWERCAP", str(tmp_path))  # the ranks inherit it
    with PackageCounter(tmp_path):
        result, _, _ = _trained(
            hydra_conf, ["trainer.strategy=ddp", "trainer.devices=2", "trainer.batch_size=16"]
        )
    assert result.energy is not None and result.energy_note == "RAPL"
    assert len(result.energy.counters) == 1 and result.energy.counters[0].endswith("intel-rapl:0")
    assert result.energy.joules > 0
    assert result.metrics()["energy/joules"] == result.energy.joules


def test_the_runs_joules_are_each_counters_once_and_a_rank_without_says_why() -> None:
    """_global over two ranks' figures: two readings of one RAPL package count once (the
    larger), two cards add; a rank that measured nothing leaves the run without joules,
    with that rank's reason, not rank 0's source."""
    from batchfit.train.launch.distributed import _global
    from batchfit.train.measure.energy import RAPL, UNMEASURED, Energy

    def results(*energies: Energy | None) -> dict[int, dict]:
        base = RunResult(6, 144, 0.0, 1.0, 100, None, 0.5, energy=energies[0],
                         energy_note=energies[0].source if energies[0] else UNMEASURED)  # fmt: skip
        figures = [
            {"num_samples": 72, "timed_samples": 64, "timed_units": 64, "timed_seconds": 2.0,
             "peak_bytes": 100, "reserved_bytes": None, "interval_rates": [],
             "energy": e, "energy_note": e.source if e else UNMEASURED}
            for e in energies
        ]  # fmt: skip
        return {r: {"figures": f, **({"result": base} if r == 0 else {})}
                for r, f in enumerate(figures)}  # fmt: skip

    package = ("h:intel-rapl:0",)
    shared = _global(results(Energy(40, 2.0, RAPL, package), Energy(42, 2.0, RAPL, package)))
    assert shared.energy.joules == 42 and shared.energy_note == RAPL
    cards = _global(results(Energy(40, 2.0, "NVML energy counter", ("GPU-a",)),
                            Energy(42, 2.0, "NVML energy counter", ("GPU-b",))))  # fmt: skip
    assert cards.energy.joules == 82
    partial = _global(results(Energy(40, 2.0, RAPL, package), None))
    assert partial.energy is None and partial.energy_note == UNMEASURED
    assert "energy/joules" not in partial.metrics()
