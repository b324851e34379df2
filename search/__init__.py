"""`python -m search`: the command-line name of batchfit's study (`batchfit search`).

The study itself is `batchfit.search`; this package only gives it the short `python -m` name,
and imports nothing else, so that a user's `train.py`, `common/` or `tracking/` beside it
never stands in for batchfit's own modules.
"""
