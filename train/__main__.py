"""One training run: `python -m train +experiment=resnet trainer.batch_size=256`
(or `batchfit train ...`)."""

from batchfit.common.overrides import run_entry_point
from batchfit.train.__main__ import main

if __name__ == "__main__":
    run_entry_point(main)
