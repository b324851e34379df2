"""Run a study: `python -m search +experiment=resnet data=digits` (or `batchfit search ...`)."""

from batchfit.common.overrides import run_entry_point
from batchfit.search.__main__ import main

if __name__ == "__main__":
    run_entry_point(main)
