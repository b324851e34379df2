"""A decoder's step built from its shallow copies (train/memory/stack.py) against the step computed
whole on fake tensors: the same events, free by free (in the canonical order of frees in a
row), hence the same live peak on CPU and the same CUDA reserve through the allocator model;
the same parameter, gradient and optimizer-state bytes. And a stack that is not periodic is
computed whole."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from batchfit.train.memory.predict import _BESIDE, MemoryPredictor, replays_beside
from batchfit.train.memory.stack import Step, _Canon, _insertions, _regions, find_stack
from batchfit.train.plan import plan
from batchfit.train.workload import Workloads

CONF = Path(__file__).resolve().parents[2] / "conf"
GPT = ["+experiment=gpt", "model.n_layer=6", "trainer.device=cpu"]
GEOMETRIES = [(1, 2, "fp32"), (3, 2, "fp32"), (2, 1, "fp32"), (2, 2, "bf16"), (1, 1, "bf16")]


def _llama(tmp_path: Path, layers: int) -> str:
    """llama3_tiny with `layers` decoder layers, as a file of one's own for model.config."""
    arch = yaml.safe_load((CONF / "architecture" / "llama3_tiny.yaml").read_text())
    path = tmp_path / "llama_deep.yaml"
    path.write_text(yaml.safe_dump({**arch, "num_hidden_layers": layers}))
    return str(path)


def _pair(hydra_conf, overrides: list[str]) -> tuple[MemoryPredictor, MemoryPredictor, object]:
    """(fast, whole) predictors of one config, and its spec."""
    cfg = hydra_conf(overrides)
    spec = plan(cfg, cfg.search.memory_budget)
    workload = Workloads().of(cfg)
    fast = workload.predictor(spec, cfg.optimizer)
    whole = workload.predictor(spec, cfg.optimizer, whole=True)
    return fast, whole, spec


def _assert_same_steps(fast: MemoryPredictor, whole: MemoryPredictor, spec, geometries) -> None:
    assert fast.depth is not None and whole.depth is None
    assert fast.state_bytes == whole.state_bytes
    for batch, accum, precision in geometries:
        trainer = dataclasses.replace(
            spec.trainer,
            batch_size=batch,
            accum_steps=accum,
            precision=precision,
            effective_batch_size=None,
        )
        sizes = [batch] * min(accum, 2)
        step = fast._built(sizes, trainer)
        assert step is not None, f"{batch}x{accum} {precision}: not built from the stack"
        computed = Step(*whole._computed(sizes, trainer))
        assert _Canon.of(step) == _Canon.of(computed), f"{batch}x{accum} {precision}"
        limit = spec.limit_bytes
        got = fast.predict(trainer, 1000, limit)
        expected = whole.predict(trainer, 1000, limit)
        assert (got.peak_bytes, got.tensor_bytes, got.reserved_bytes) == (
            expected.peak_bytes,
            expected.tensor_bytes,
            expected.reserved_bytes,
        )


def test_a_gpt_step_on_cpu_is_built_to_the_byte(hydra_conf):
    fast, whole, spec = _pair(hydra_conf, GPT)
    assert fast.depth == 6
    _assert_same_steps(fast, whole, spec, GEOMETRIES)


def test_a_gpt_step_planned_for_a_gpu_has_the_same_cuda_reserve(hydra_conf):
    fast, whole, spec = _pair(hydra_conf, [*GPT, "search.gpu=A100-40GB"])
    _assert_same_steps(fast, whole, spec, GEOMETRIES[:4])


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_llama_step_planned_for_a_gpu_is_built_exactly(hydra_conf, tmp_path, lora):
    """A frozen embedding makes the first layer's backward shorter (no gradient for its
    input): only the layers after it repeat, which depths 2-4 see."""
    overrides = [
        "+experiment=llm_lora",
        f"model.config={_llama(tmp_path, 8)}",
        "data.max_bytes=20000",
        "data.seq_len=32",
        "trainer.device=cpu",
        "search.gpu=H100-80GB",
        *([] if lora else ["model.lora=null"]),
    ]
    fast, whole, spec = _pair(hydra_conf, overrides)
    assert fast.depth == 8
    geometries = [(1, 2, "fp32"), (2, 2, "fp32"), (2, 1, "fp32"), (1, 2, "bf16"), (2, 2, "bf16")]
    _assert_same_steps(fast, whole, spec, geometries)


def test_activation_checkpointing_and_fsdp_ranks_are_built_exactly(hydra_conf):
    overrides = [*GPT, "trainer.activation_checkpointing=blocks"]
    fast, whole, spec = _pair(hydra_conf, overrides)
    _assert_same_steps(fast, whole, spec, [(2, 2, "fp32"), (1, 1, "bf16")])
    fsdp = [*GPT, "trainer.strategy=fsdp", "trainer.devices=2"]
    fast, whole, spec = _pair(hydra_conf, fsdp)
    _assert_same_steps(fast, whole, spec, [(2, 2, "fp32")])


class _Odd(nn.Module):
    """Six identical layers, every second one run twice: not periodic in one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if i % 2:
                x = torch.relu(layer(x))
        return self.head(x)


def test_a_stack_whose_steps_are_not_periodic_is_computed_whole():
    example = (torch.zeros(4, 16), torch.zeros(4, dtype=torch.long))
    fast = MemoryPredictor(_Odd, lambda p: torch.optim.SGD(p, lr=0.1), example, torch.device("cpu"))
    whole = MemoryPredictor(
        _Odd, lambda p: torch.optim.SGD(p, lr=0.1), example, torch.device("cpu"), whole=True
    )
    assert fast.depth == 6
    from batchfit.train.config import TrainerConfig

    trainer = TrainerConfig(batch_size=4, accum_steps=2)
    assert fast._built([4, 4], trainer) is None  # depth 4 does not come out of 2 and 3
    assert fast.predict(trainer, 100).peak_bytes == whole.predict(trainer, 100).peak_bytes


def test_a_stack_is_a_module_list_of_identical_layers():
    same = nn.Sequential(nn.ModuleList(nn.Linear(4, 4) for _ in range(5)))
    assert find_stack(same) is same[0]
    mixed = nn.ModuleList([*(nn.Linear(4, 4) for _ in range(4)), nn.Linear(4, 8)])
    assert find_stack(mixed) is None
    short = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
    assert find_stack(short) is None  # no deeper than the copies of 2-4 layers
    assert find_stack(short, min_depth=4) is short


def test_the_fewest_insertions_turn_one_sequence_into_the_other():
    one = [1, 2, 3, 9, 4, 5, 6]
    two = [1, 2, 3, 2, 3, 9, 4, 5, 6, 5, 6]
    found = _insertions(one, two)
    assert len(found) == 2
    rebuilt = list(one)
    for position, run in sorted(found, reverse=True):
        rebuilt[position:position] = run
    assert rebuilt == two
    # Slid to the front of their runs, each region is followed by its own copy.
    assert _regions(one, two) == [(1, 2), (5, 2)]
    assert _insertions([1, 2, 3], [1, 3, 2]) is None  # not a subsequence
    assert _regions([1, 2, 3], [1, 2, 7, 3]) is None  # 7 copies nothing


def test_replays_in_a_second_process_give_the_same_predictions(hydra_conf):
    """replays_beside: the allocator's replays of prefetched cells run in a forked worker
    while the next cells' steps are computed; the predictions are those of one process."""
    # A budget that binds: some cells run out under it (no reserve), others reserve less
    cfg = hydra_conf([*GPT, "search.gpu=A100-40GB", "search.memory_budget=24MiB"])
    spec = plan(cfg, cfg.search.memory_budget)
    geometries = [
        dataclasses.replace(
            spec.trainer, batch_size=b, accum_steps=a, precision=p, effective_batch_size=None
        )
        for b, a, p in GEOMETRIES
    ]
    beside = Workloads().of(cfg).predictor(spec, cfg.optimizer)
    with replays_beside():
        assert _BESIDE  # the second process, forked at the first replay
        keys = [beside.prefetch(trainer, 1000, spec.limit_bytes) for trainer in geometries]
        got = [beside.predict(t, 1000, spec.limit_bytes) for t in geometries]
        assert all(beside.ready(key) for key in keys)
    assert not _BESIDE
    here = Workloads().of(cfg).predictor(spec, cfg.optimizer)
    expected = [here.predict(t, 1000, spec.limit_bytes) for t in geometries]
    figures = [(p.peak_bytes, p.tensor_bytes, p.reserved_bytes) for p in got]
    assert figures == [(p.peak_bytes, p.tensor_bytes, p.reserved_bytes) for p in expected]
    assert None in [p.reserved_bytes for p in got], "the budget should bind somewhere"
