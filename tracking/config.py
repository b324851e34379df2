"""Config checking shared by every side: the error that reports every problem of a config
at once, each naming its key and the fix; unknown keys with the closest known one; where a YAML
file is broken; a typed section from a mapping. It lives in tracking, the bottom layer, which
imports neither train nor search, so that all three raise the same error.
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
