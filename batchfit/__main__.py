"""`python -m batchfit search|fit|train ...`: the `batchfit` command (batchfit/cli.py)."""

from batchfit.cli import main

if __name__ == "__main__":
    main()
