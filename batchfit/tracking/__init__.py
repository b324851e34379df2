"""MLflow logging shared by `python -m search` and `python -m train`: runs, their queued
writes, passwords masked, and the clock of the time spent in these calls."""
