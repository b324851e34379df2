"""common/overrides.py `override_key`: the key of an override as Hydra's own parser reads it."""

from __future__ import annotations

import pytest

from batchfit.common.checks import ConfigError
from batchfit.common.overrides import merge_overrides, override_key


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.batch_size=32", "trainer.batch_size"),
        ("+a.b=1", "a.b"),
        ("++seed=3", "seed"),
        ("~loader", "loader"),
        ("~a.b=2", "a.b"),
        ("model@x=foo", "model@x"),  # a group at a package: the package is part of the key
        ("hydra.searchpath=[file:///x]", "hydra.searchpath"),
        ('search.params={optimizer.lr:"tag(log, interval(0.01, 0.3))"}', "search.params"),
        ("data.tokenizer='a=b'", "data.tokenizer"),
        ("optimizer.lr=${base_lr}", "optimizer.lr"),
    ],
)
def test_the_key_of_an_override_is_hydras(override: str, key: str) -> None:
    assert override_key(override) == key


@pytest.mark.parametrize("override", ["trainer.batch_size", "a b=1", "x=[1,2"])
def test_what_hydra_cannot_parse_is_a_config_error_that_quotes_it(override: str) -> None:
    with pytest.raises(ConfigError) as raised:
        override_key(override)
    (problem,) = raised.value.problems
    assert problem.startswith(f"{override!r} is not a Hydra override ("), problem


def test_a_later_override_of_a_key_wins_and_a_package_is_a_key_of_its_own() -> None:
    """A `+` does not change the key (`seed=2` replaces `+seed=1`); a group at a package
    (`model@x`) is not the group itself (`model`)."""
    assert merge_overrides(["model@x=a", "+seed=1"], ["model=b", "seed=2"]) == [
        "model@x=a",
        "model=b",
        "seed=2",
    ]
