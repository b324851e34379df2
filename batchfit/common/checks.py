"""Config checking shared by every side: the error that reports every problem of a config
at once, each naming its key and the fix; unknown keys with the closest known one; where a YAML
file is broken; a typed section from a mapping. It lives in common, the bottom layer, which
imports none of tracking, train and search, so that all of them raise the same error.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """One or more problems in the composed configuration, each naming its key and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(f"- {p}" for p in self.problems))


def unknown_keys(
    section: str, keys: Iterable[str], known: Iterable[str], owner: str | None = None
) -> list[str]:
    """One problem per key of `section` that is not in `known` (a typo, or a key added with
    `+` that nothing reads), with the known keys and the closest one. `owner`: what the key
    is not, e.g. 'a setting of torch.optim.SGD' (default: 'a <section> setting')."""
    known = sorted(known)
    owner = owner or f"a {section} setting"
    problems = []
    for key in sorted(set(keys) - set(known)):
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean {section}.{close[0]}?" if close else ""
        problems.append(f"{section}.{key} is not {owner}; known: {', '.join(known)}{hint}")
    return problems


def not_yaml(path: str | Path, text: str, error: yaml.YAMLError) -> str:
    """Where and why `text`, read from `path`, is not YAML: `PATH:LINE:COLUMN is not valid
    YAML (what)`, 1-based like an editor's, so that the message alone finds the mistake."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    if mark is not None:
        where = f"{path}:{mark.line + 1}:{mark.column + 1}"
    elif isinstance(error, yaml.reader.ReaderError):  # a character YAML refuses: NUL, ...
        line = text.count("\n", 0, error.position) + 1
        column = error.position - (text.rfind("\n", 0, error.position) + 1) + 1
        where = f"{path}:{line}:{column}"
    else:
        where = str(path)
    what = getattr(error, "problem", None) or getattr(error, "reason", None) or str(error)
    if isinstance(error, yaml.reader.ReaderError) and isinstance(error.character, int):
        what = f"character U+{error.character:04X}: {what}"
    return f"{where} is not valid YAML ({str(what).splitlines()[0]})"


def section_from_mapping(
    cls: type, section: str, values: dict[str, Any], owner: str | None = None
) -> Any:
    """`cls` from a config section's values; unknown keys and the checks' problems reported
    together, each naming `section.<key>`."""
    known = {f.name for f in fields(cls)}
    problems = unknown_keys(section, values, known, owner)
    try:
        config = cls(**{k: v for k, v in values.items() if k in known})
    except ConfigError as error:
        problems += error.problems
    if problems:
        raise ConfigError(problems)
    return config


# The checks every config section makes, with one wording: `KEY must be WHAT, got VALUE; FIX`,
# where FIX is `override with KEY=VALUE` unless a check says more (`hint`). Each returns the
# problems it found (none or one), for the caller to report with the others.


def must_be(key: str, what: str, value: Any, fix: Any = None, hint: str | None = None) -> str:
    """The problem with `key`: what it must be, what it is, and `override with KEY=FIX` (or
    `hint`, when the fix takes more than a value)."""
    return f"{key} must be {what}, got {value!r}; {hint or f'override with {key}={fix}'}"


def is_integer(value: Any, minimum: int) -> bool:
    """An int (not a bool, which Python counts as one) >= `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def integer_problems(
    key: str,
    value: Any,
    minimum: int,
    *,
    or_null: bool = False,
    fix: Any = None,
    hint: str | None = None,
) -> list[str]:
    """`key` must be an integer >= `minimum` (or None with `or_null`); fix: `minimum`."""
    if (or_null and value is None) or is_integer(value, minimum):
        return []
    what = f"an integer >= {minimum}{' or null' if or_null else ''}"
    return [must_be(key, what, value, minimum if fix is None else fix, hint)]


def number_problems(
    key: str,
    value: Any,
    what: str,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    or_null: bool = False,
    fix: Any = None,
    hint: str | None = None,
) -> list[str]:
    """`key` must be a number > `above`, >= `at_least` and < `below` (those given; NaN is
    none of them), or None with `or_null`; `what` says so in words, e.g. 'a number >= 0'."""
    if or_null and value is None:
        return []
    if is_number(value) and (
        (above is None or value > above)
        and (at_least is None or value >= at_least)
        and (below is None or value < below)
    ):
        return []
    return [must_be(key, f"{what}{' or null' if or_null else ''}", value, fix, hint)]


def choice_problems(key: str, value: Any, choices: Iterable[Any], fix: Any) -> list[str]:
    """`key` must be one of `choices`, suggesting the choice `value` meant (`closest_choice`),
    else `key=fix`."""
    choices = tuple(choices)
    if value in choices:
        return []
    meant = closest_choice(value, choices)
    what = f"one of {', '.join(map(str, choices))}"
    return [must_be(key, what, value, fix if meant is None else meant)]


# difflib's ratio a choice must reach to be offered: a swap or a letter off in 4+ letters
# (bf61 -> bf16: 0.75; cda -> cuda: 0.86), not another short word (gpu -> cpu: 0.67).
_CLOSE_CHOICE = 0.7


def closest_choice(value: Any, choices: Iterable[Any]) -> Any:
    """The choice a string `value` was meant to be: the one it is but for case (`FP32` ->
    `fp32`), else the closest by difflib (`bf61` -> `bf16`); None when none is close."""
    if not isinstance(value, str):
        return None
    by_name = {str(choice).casefold(): choice for choice in choices}
    folded = value.casefold()
    if folded in by_name:
        return by_name[folded]
    close = difflib.get_close_matches(folded, list(by_name), n=1, cutoff=_CLOSE_CHOICE)
    return by_name[close[0]] if close else None


def flag_problems(key: str, value: Any, fix: bool = True) -> list[str]:
    """`key` must be true or false (a bool: YAML's `yes` is one, the string 'false' is not)."""
    if isinstance(value, bool):
        return []
    return [must_be(key, "true or false", value, str(fix).lower())]
