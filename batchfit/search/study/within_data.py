"""A search space kept within its data: a batch larger than the training set would train each
epoch as one short step of all of it, at a learning rate scaled for the batch asked for.

Searched batch sizes (or effective batches) beyond the training set are dropped before trial 0
and said; a space none of whose values fits is refused. What single values cannot say (a
micro-batch times an accumulation beyond the data) is pruned per trial as `over_data`
(search/trial/objective.py), before it trains.
"""

from __future__ import annotations

from optuna.distributions import CategoricalDistribution, IntDistribution

from batchfit.search.sampling.space import SearchSpace
from batchfit.train.config import TrainerConfig
from batchfit.train.params import ACCUM_KEY, BATCH_KEY, EFFECTIVE_KEY


def keep_within_data(
    space: SearchSpace, trainer: TrainerConfig, num_train: int, data: str
) -> tuple[list[str], list[str]]:
    """(notes, problems): the searched batch values of `space` over `num_train` samples
    (times trainer.devices) dropped, in place; a problem where none is left, or where the
    smallest step the space can draw is already larger than the data."""
    per_device = num_train // trainer.devices  # samples of a step a device's share fills
    where = f"the {num_train} training samples of {data}" + (
        f" over trainer.devices={trainer.devices}" if trainer.devices > 1 else ""
    )
    notes, problems = [], []
    for key in (BATCH_KEY, EFFECTIVE_KEY):
        dist = space.distributions.get(key)
        # a micro-batch beyond the data at the least accumulation drawn with it
        accum = _least(space, trainer, ACCUM_KEY) if key == BATCH_KEY else 1
        limit = per_device // accum
        beyond = f"larger than {where}" if accum == 1 else f"x{accum} steps: larger than {where}"
        if isinstance(dist, CategoricalDistribution):
            dropped = space.restrict_choices(key, lambda c, limit=limit: int(c) <= limit)
            if dropped:
                notes.append(f"{key}: dropped {', '.join(map(str, dropped))} ({beyond})")
            elif min(map(int, dist.choices)) > limit:
                problems.append(
                    f"search.params.{key}: every value is larger than {where}; search values "
                    f"up to {limit}"
                )
        elif isinstance(dist, IntDistribution) and dist.high > limit:
            if dist.low > limit:
                problems.append(
                    f"search.params.{key}: range({dist.low}, {dist.high}) is larger than "
                    f"{where}; search values up to {limit}"
                )
            else:
                high = dist.low + (limit - dist.low) // dist.step * dist.step
                space.distributions[key] = IntDistribution(
                    dist.low, high, log=dist.log, step=dist.step
                )
                notes.append(f"{key}: searched up to {high}, not {dist.high} ({beyond})")
    smallest = (
        _least(space, trainer, EFFECTIVE_KEY)
        if EFFECTIVE_KEY in space.distributions
        else _least(space, trainer, BATCH_KEY) * _least(space, trainer, ACCUM_KEY)
    )
    if not problems and smallest > per_device:
        problems.append(
            f"the smallest step the space draws, {smallest} samples a device, is larger than "
            f"{where}; lower trainer.batch_size or trainer.accum_steps (or their values in "
            "search.params)"
        )
    return notes, problems


def _least(space: SearchSpace, trainer: TrainerConfig, key: str) -> int:
    """The smallest value of `key` the space draws; a key not searched, its fixed or
    configured value."""
    dist = space.distributions.get(key)
    if isinstance(dist, CategoricalDistribution):
        return min(int(c) for c in dist.choices)
    if isinstance(dist, IntDistribution):
        return dist.low
    configured = getattr(trainer, key.removeprefix("trainer."))
    return int(space.fixed.get(key, configured or 1))
