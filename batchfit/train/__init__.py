"""batchfit's training side: models, data, precision, memory budget and the training loop.

Nothing here knows about Optuna or MLflow: the loop exposes hooks and the study driver in
`search/` uses them to report, prune and log.
"""
