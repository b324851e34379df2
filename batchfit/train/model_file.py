"""The trained model as one file: its state_dict and the config that builds it again.

`python -m train` writes it as the MLflow artifact `model/model.pt` of its run, and to
`+save=PATH` when given. To use it:

    from batchfit.train.model_file import load, rebuild
    saved = load("model.pt")
    model = rebuild(saved)  # built from saved.config, weights loaded, on the CPU

The file holds tensors, strings and lists only, so `torch.load(weights_only=True)` reads it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from batchfit.train.build import build_model, build_pipeline, build_task

FILE_NAME = "model.pt"
ARTIFACT_PATH = "model"  # the MLflow run's artifact directory holding FILE_NAME


@dataclass(frozen=True)
class SavedModel:
    state_dict: dict[str, torch.Tensor]
    config_yaml: str  # the run's resolved config (passwords masked by the caller)
    # The overrides that composed it (the search path first, if given, then the task's);
    # config_yaml is complete without them, and rebuild() uses it alone
    overrides: list[str]

    @property
    def config(self) -> DictConfig:
        return OmegaConf.create(self.config_yaml)


def to_bytes(model: torch.nn.Module, config_yaml: str, overrides: list[str]) -> bytes:
    """The file's content; tensors are copied to the CPU, so any machine can read it."""
    state = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    buffer = io.BytesIO()
    torch.save({"state_dict": state, "config": config_yaml, "overrides": list(overrides)}, buffer)
    return buffer.getvalue()


def load(path: str | Path) -> SavedModel:
    content = torch.load(path, map_location="cpu", weights_only=True)
    return SavedModel(content["state_dict"], content["config"], list(content["overrides"]))


def rebuild(saved: SavedModel, device: str = "cpu") -> torch.nn.Module:
    """The model of `saved.config`, built as a run builds it (its data gives the shapes of
    lazy layers and the builder's `info` arguments), with the saved weights."""
    cfg = saved.config
    pipeline = build_pipeline(cfg, torch.device(device))
    model = build_model(cfg, pipeline, build_task(cfg), cfg.trainer.activation_checkpointing)
    model.load_state_dict(saved.state_dict)
    return model.to(device)
