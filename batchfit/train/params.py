"""The names of a run's batch geometry, precision and what follows from them.

`train.config.RunSpec.params` gives a run's values under these names; a trial's user attrs and
its MLflow params carry them, and search/ reads them back by them. Plain strings, no torch:
importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Config keys, as on the command line.
BATCH_KEY = "trainer.batch_size"
ACCUM_KEY = "trainer.accum_steps"
PRECISION_KEY = "trainer.precision"
CHECKPOINTING_KEY = "trainer.activation_checkpointing"
EFFECTIVE_KEY = "trainer.effective_batch_size"  # set with search.accumulation=derived
STRATEGY_KEY = "trainer.strategy"  # none | ddp | fsdp
DEVICES_KEY = "trainer.devices"  # ranks of a data-parallel run
# What follows from them: derived values, not config keys.
EFFECTIVE_PARAM = "effective_batch_size"  # batch_size x accum_steps
LR_PARAM = "lr_scaled"  # optimizer.lr scaled to the global batch by trainer.lr_scaling
LR_RULE_PARAM = "lr_rule"  # the rule that scaled it: trainer.lr_scaling, `auto` resolved
LR_REF_PARAM = "lr_reference"  # the global batch at which optimizer.lr is the rate
GLOBAL_PARAM = "global_batch_size"  # effective_batch_size x trainer.devices

# Levers a config sets where its model and data have them (a language model's): logged with
# every run and named in its run name, so that a LoRA, a QLoRA and a full fine-tuning run of
# the same batch geometry are told apart.
QUANTIZATION_KEY = "model.quantization"  # none | nf4 | fp4: 4-bit base weights (QLoRA)
LORA_RANK_KEY = "model.lora.r"  # the adapters' rank; null: full fine-tuning
SEQ_LEN_KEY = "data.seq_len"  # tokens per sequence: memory follows batch x this
LEVER_KEYS = (SEQ_LEN_KEY, LORA_RANK_KEY, QUANTIZATION_KEY)


def lever_params(cfg: Any) -> dict[str, Any]:
    """The levers of LEVER_KEYS `cfg` (a DictConfig) has, by key: model.lora.r is null for a
    model with `lora: null` (full fine-tuning); a key the config lacks is left out."""
    from omegaconf import OmegaConf

    missing = object()
    found = {}
    for key in LEVER_KEYS:
        parent = key.rsplit(".", 1)[0]
        if OmegaConf.select(cfg, parent, default=missing) is None and key == LORA_RANK_KEY:
            found[key] = None  # `model.lora: null`
            continue
        value = OmegaConf.select(cfg, key, default=missing)
        if value is not missing:
            found[key] = value
    return found


def lever_words(params: Mapping[str, Any]) -> list[str]:
    """'seq 256', 'LoRA r16' or 'full', 'nf4': the levers of `params` in a run's name."""
    words = []
    if params.get(SEQ_LEN_KEY) is not None:
        words.append(f"seq {params[SEQ_LEN_KEY]}")
    if LORA_RANK_KEY in params:
        rank = params[LORA_RANK_KEY]
        words.append(f"LoRA r{rank}" if rank is not None else "full")
    quantization = params.get(QUANTIZATION_KEY)
    if quantization not in (None, "none"):
        words.append(str(quantization))
    return words
