"""Hydra overrides as data: the key an override sets, an ordered merge where a later key
wins, and the overrides of a best.yaml (`python -m train +best=PATH`, written by a study's
search/recommend.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from train.config import ConfigError

BEST_FILE = "best.yaml"
BEST_KEY = "best"  # python -m train +best=PATH


def override_key(override: str) -> str:
    """The config key of a Hydra override: `+a.b=1` -> `a.b`."""
    return override.split("=", 1)[0].lstrip("+~")


def load_overrides(path: str | Path) -> list[str]:
    """The overrides of a best.yaml, for `python -m train +best=PATH`."""
    file = Path(path).expanduser()
    fix = f"give the path of a {BEST_FILE} a study wrote, e.g. +{BEST_KEY}=mlruns/.../{BEST_FILE}"
    if not file.is_file():
        raise ConfigError([f"{BEST_KEY}={str(path)!r}: no such file; {fix}"])
    loaded = yaml.safe_load(file.read_text())  # as written: ${...} stays an interpolation
    overrides = loaded.get("overrides") if isinstance(loaded, Mapping) else None
    if (
        not isinstance(overrides, list)
        or not overrides
        or not all(isinstance(o, str) for o in overrides)
    ):
        raise ConfigError([f"{BEST_KEY}={str(path)!r} has no list of overrides; {fix}"])
    return list(overrides)


def merge_overrides(first: Sequence[str], then: Sequence[str]) -> list[str]:
    """`first`, less the keys `then` sets, followed by `then`: the later one wins."""
    later = {override_key(o) for o in then}
    return [o for o in first if override_key(o) not in later] + list(then)
