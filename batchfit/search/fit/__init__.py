"""The fit report: which batch sizes fit the memory budget, per accumulation and precision,
without training.

    python -m search.fit +experiment=resnet data=digits

For every precision, batch size and accumulation of the search space, with the base config's
model and optimizer (other searched keys at their configured values), the predicted peak
memory of a training step (train/memory/predict.py: the step computed on fake tensors) and the
largest batch size that fits the budget with the margin to spare (search.preflight_margin, by
default from the prediction's measured error for the kind of step: the title says which and
why, with where the budget comes from). Accumulation matters: the second micro-batch of a
step runs over the gradients the first one left, so it can peak higher. Accumulations whose
peaks are the same at every batch size and precision share one block of rows. A precision
this device cannot run (tf32 off CUDA) is shown as n/a with the reason; trials skip it. With
search.accumulation=derived, the rows are the searched effective batch sizes and each cell
gives the micro-batch x accumulation a trial would train with. A study logs the same table
to its parent MLflow run (`fit_report.json`, `fit_report.txt`).
"""
