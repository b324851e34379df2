"""batchfit's study driver: search space, objective, study storage, MLflow tracking, report."""
