"""What fits, in seconds: `python -m search.fit +experiment=resnet data=digits`
(or `batchfit fit ...`)."""

from batchfit.common.overrides import run_entry_point
from batchfit.search.fit.__main__ import main

if __name__ == "__main__":
    run_entry_point(main)
