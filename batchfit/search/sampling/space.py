"""The search space: config keys mapped to Optuna distributions.

Values use hydra-optuna-sweeper's `params` grammar, parsed by Hydra's own override parser, so
a plugin user's block can be copied over: `choice(16, 32)` is categorical, `range(1, 9)` an
integer range (the plugin's reading: both ends included), `interval(1e-4, 1e-1)` a float
range, `tag(log, interval(...))` the same on a log scale. A plain value fixes the key for all
trials.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, Transformer
from hydra.errors import HydraException
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from batchfit.common.checks import ConfigError


@dataclass(frozen=True)
class SearchSpace:
    distributions: dict[str, BaseDistribution]
    fixed: dict[str, str] = field(default_factory=dict)  # key -> override value, every trial

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """Sample every key through Optuna's public suggest API."""
        params: dict[str, Any] = {}
        for key, dist in self.distributions.items():
            if isinstance(dist, CategoricalDistribution):
                params[key] = trial.suggest_categorical(key, dist.choices)
            elif isinstance(dist, IntDistribution):
                params[key] = trial.suggest_int(
                    key, dist.low, dist.high, step=dist.step, log=dist.log
                )
            else:
                assert isinstance(dist, FloatDistribution)
                params[key] = trial.suggest_float(
                    key, dist.low, dist.high, step=dist.step, log=dist.log
                )
        return params

    def size(self) -> int | None:
        """How many configurations the space holds; None when a key is continuous."""
        count = 1
        for dist in self.distributions.values():
            if isinstance(dist, CategoricalDistribution):
                count *= len(dist.choices)
            elif isinstance(dist, IntDistribution):
                count *= (dist.high - dist.low) // dist.step + 1
            elif dist.step is not None:
                count *= round((dist.high - dist.low) / dist.step) + 1
            else:
                return None
        return count

    def overrides(self, params: Mapping[str, Any]) -> list[str]:
        """Hydra overrides for sampled values, fixed values included."""
        values = {**self.fixed, **{k: override_value(v) for k, v in params.items()}}
        return [f"{key}={value}" for key, value in values.items()]

    def describe(self, key: str) -> str:
        """`key`'s distribution in the `params` grammar, as it is searched now (after any
        values were dropped): choice(16, 32), range(16, 992, step=16), tag(log, interval(...))."""
        dist = self.distributions[key]
        if isinstance(dist, CategoricalDistribution):
            return f"choice({', '.join(override_value(c) for c in dist.choices)})"
        if isinstance(dist, IntDistribution) and not dist.log:
            step = f", step={dist.step}" if dist.step != 1 else ""
            return f"range({dist.low}, {dist.high}{step})"
        if isinstance(dist, FloatDistribution) and dist.step is not None:
            return f"range({dist.low:g}, {dist.high:g}, step={dist.step:g})"
        interval = f"interval({dist.low:g}, {dist.high:g})"
        return f"tag(log, {interval})" if dist.log else interval

    def restrict_choices(self, key: str, keep: Any) -> list[Any]:
        """Drop the choices of `key` for which `keep(choice)` is false; return the dropped."""
        dist = self.distributions.get(key)
        if not isinstance(dist, CategoricalDistribution):
            return []
        kept = [c for c in dist.choices if keep(c)]
        dropped = [c for c in dist.choices if not keep(c)]
        if dropped and kept:
            self.distributions[key] = CategoricalDistribution(kept)
        return dropped if kept else []


def override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def parse_space(params: Mapping[str, Any]) -> SearchSpace:
    """Parse `search.params`; every problem is reported at once in a ConfigError. A key set
    to null is not searched (`'++search.params={trainer.precision:null}'` drops a key an
    experiment searches; trials then use the config's own value)."""
    parser = OverridesParser.create()
    distributions: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    problems: list[str] = []
    for key, text in params.items():
        if text is None:
            continue
        where = f"search.params.{key}"
        try:
            (override,) = parser.parse_overrides([f"{key}={text}"])
        except HydraException as error:
            problems.append(
                f"{where}: cannot parse {text!r} ({str(error).splitlines()[0]}); write e.g. "
                "choice(16,32,64), interval(0.01,0.1), tag(log, interval(1e-4,1e-1)) or range(1,9)"
            )
            continue
        if not override.is_sweep_override():
            fixed[key] = override.get_value_element_as_str()
            continue
        try:
            distributions[key] = _distribution(override, str(text))
        except ValueError as error:
            problems.append(f"{where}: {error}")
    if problems:
        raise ConfigError(problems)
    return SearchSpace(distributions, fixed)


def _distribution(override: Override, text: str) -> BaseDistribution:
    value = override.value()
    if override.is_choice_sweep():
        choices = list(override.sweep_iterator(transformer=Transformer.encode))
        if not choices:
            raise ValueError(f"{text} has no choices; give at least one")
        return CategoricalDistribution(choices)
    if override.is_range_sweep():
        start, stop, step = value.start, value.stop, value.step
        if value.shuffle:
            return CategoricalDistribution(list(override.sweep_iterator(Transformer.encode)))
        _check_bounds(text, start, stop, log=False)
        if not step > 0:
            raise ValueError(f"{text} has step {step}; the step must be > 0")
        if any(isinstance(v, float) for v in (start, stop, step)):
            return FloatDistribution(start, stop, step=step)
        return IntDistribution(int(start), int(stop), step=int(step))
    if override.is_interval_sweep():
        log = "log" in value.tags
        _check_bounds(text, value.start, value.end, log)
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(value.start, value.end, log=log)
    raise ValueError(f"{text} is not a supported sweep; use choice, range or interval")


def _check_bounds(text: str, low: float, high: float, log: bool) -> None:
    if low > high:
        raise ValueError(f"{text} has low {low} > high {high}; swap the bounds")
    if log and low <= 0:
        raise ValueError(
            f"{text} is on a log scale but its low bound {low} is not positive; "
            "use a bound > 0, e.g. tag(log, interval(1e-4, 1e-1))"
        )
