"""What a study samples: the search space (hydra-optuna-sweeper grammar to Optuna distributions),
the default space of the four levers, and the sampler that proposes no configuration beyond a
known OOM."""
