"""batchfit: the batch size, accumulation, precision and learning rate to train with, under a
device-memory budget, predicted before anything is paid.

What this module exports is the supported surface (everything else in the package is
private, and may change between releases):

- predicting a training step of your own model before paying for it: `predict_peak`,
  `largest_batch`, `fit_table` (and `StepPredictor` to ask many questions of one model),
  answered as `Prediction`, `Breakdown` and `FitTable` for this machine or a named card;
- a study from Python: `study(overrides)`, its answer a `StudyResult` holding the
  `Recommendation` (configuration, learning rate, figures, the command that trains it);
- bring your own training to a study: `Datasets` and `Splits` (data), `Task` and its bundled
  subclasses (forward, loss, units and validation metrics);
- from the command line: `batchfit search|fit|train` (`batchfit.cli`).

Names are imported at first use (PEP 562), so `import batchfit` and `batchfit --help` do not
pay for torch, Optuna and MLflow until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the private module that defines it
_EXPORTS = {
    "predict_peak": "batchfit.prediction",
    "largest_batch": "batchfit.prediction",
    "StepPredictor": "batchfit.prediction",
    "Prediction": "batchfit.prediction",
    "Breakdown": "batchfit.prediction",
    "PredictionUnsupported": "batchfit.prediction",
    "fit_table": "batchfit.table",
    "study": "batchfit.studies",
    "StudyResult": "batchfit.studies",
    "Recommendation": "batchfit.studies",
    "FitTable": "batchfit.table",
    "ConfigError": "batchfit.common.checks",
    "Datasets": "batchfit.train.data",
    "Splits": "batchfit.train.data",
    "Task": "batchfit.train.tasks",
    "ArgmaxAccuracy": "batchfit.train.tasks",
    "Classification": "batchfit.train.tasks",
    "Regression": "batchfit.train.tasks",
    "LanguageModel": "batchfit.train.tasks",
    "CausalLM": "batchfit.train.tasks",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from batchfit.common.checks import ConfigError as ConfigError
    from batchfit.prediction import Breakdown as Breakdown
    from batchfit.prediction import Prediction as Prediction
    from batchfit.prediction import PredictionUnsupported as PredictionUnsupported
    from batchfit.prediction import StepPredictor as StepPredictor
    from batchfit.prediction import largest_batch as largest_batch
    from batchfit.prediction import predict_peak as predict_peak
    from batchfit.studies import Recommendation as Recommendation
    from batchfit.studies import StudyResult as StudyResult
    from batchfit.studies import study as study
    from batchfit.table import FitTable as FitTable
    from batchfit.table import fit_table as fit_table
    from batchfit.train.data import Datasets as Datasets
    from batchfit.train.data import Splits as Splits
    from batchfit.train.tasks import ArgmaxAccuracy as ArgmaxAccuracy
    from batchfit.train.tasks import CausalLM as CausalLM
    from batchfit.train.tasks import Classification as Classification
    from batchfit.train.tasks import LanguageModel as LanguageModel
    from batchfit.train.tasks import Regression as Regression
    from batchfit.train.tasks import Task as Task


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'batchfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
