"""The names of a run's batch geometry, precision and what follows from them.

`train.config.RunSpec.params` gives a run's values under these names; a trial's user attrs and
its MLflow params carry them, and search/ reads them back by them. Plain strings, no torch:
importing this module costs nothing.
"""

from __future__ import annotations

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
