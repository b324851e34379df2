"""Hydra overrides as data: the key an override sets, an ordered merge where a later key
wins, the overrides of a best.yaml (`python -m train +best=PATH`, written by a study's
search/results/recommend.py), and the command line's keys checked against the config, so that a
typo gets "did you mean ...?" instead of Hydra's advice or a run that ignores it.
"""

from __future__ import annotations

import difflib
import functools
import gc
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
import yaml
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import (
    ConfigCompositionException,
    HydraException,
    MissingConfigException,
    OverrideParseException,
)
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError
from rich.console import Console

from batchfit.common.checks import ConfigError, not_yaml
from batchfit.common.console import config_error

CONF = Path(__file__).resolve().parents[2] / "conf"  # the entry points' config_path
BEST_FILE = "best.yaml"
BEST_KEY = "best"  # python -m train +best=PATH


@functools.lru_cache(maxsize=4096)  # a study asks again for the same command line's keys
def override_key(override: str) -> str:
    """The config key of a Hydra override, as Hydra's parser reads it: `+a.b=1` -> `a.b`,
    `~a.b` -> `a.b`, a group at a package `model@x=foo` -> `model@x`. One that does not parse
    is a ConfigError that quotes it."""
    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException as error:  # OverrideParseException, or the grammar's own
        raise ConfigError([f"{override!r} is not a Hydra override ({error})"]) from None
    if parsed.package is not None:
        return f"{parsed.key_or_group}@{parsed.package}"
    return parsed.key_or_group


def load_overrides(path: str | Path) -> list[str]:
    """The overrides of a best.yaml, for `python -m train +best=PATH`."""
    file = Path(path).expanduser()
    fix = f"give the path of a {BEST_FILE} a study wrote, e.g. +{BEST_KEY}=mlruns/.../{BEST_FILE}"
    if not file.is_file():
        raise ConfigError([f"{BEST_KEY}={str(path)!r}: no such file; {fix}"])
    text = file.read_text(errors="replace")  # a NUL or binary byte: said by YAML, with its line
    try:
        loaded = yaml.safe_load(text)  # as written: ${...} stays an interpolation
    except yaml.YAMLError as error:
        problem = not_yaml(file, text, error)
        raise ConfigError(
            [f"{BEST_KEY}={str(path)!r}: {problem}; fix the file, or {fix}"]
        ) from None
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


def _top_level_problem(head: str, override: str, known: list[str]) -> str:
    close = difflib.get_close_matches(head, known, n=1)
    fix = (
        f"did you mean {close[0]}? ({close[0]}{override.split(head, 1)[1]})"
        if close
        else f"remove {override}"
    )
    return f"{head} is not a top-level key of the config; known: {', '.join(known)}; {fix}"


def unknown_top_level(
    cfg: DictConfig, overrides: Sequence[str], own: Iterable[str] = ()
) -> list[str]:
    """One problem per top-level key that a `+` override added and nothing reads (`+sed=5`
    for seed): Hydra adds any key it is given with `+`, and the run would train with the
    config's seed while its rerun command carried the typo. `own`: the entry point's own
    top-level keys (`best`, `save` of python -m train). A config group (`+experiment=resnet`,
    a user's own on the search path) is not a key; nor is Hydra's `hydra`. Called within
    the entry point's @hydra.main, whose config it composes again without the added keys."""
    own = set(own)
    loader = GlobalHydra.instance().config_loader()
    added: dict[str, str] = {}  # top-level key -> the first override that adds it
    for override in overrides:
        key = override_key(override)
        head = key.split(".", 1)[0]
        if not override.startswith("+") or head in own or head == "hydra" or "@" in key:
            continue
        if "/" in key or loader.get_group_options(head):
            continue
        added.setdefault(head, override)
    # a key some value reads (`+base_lr=1e-3 optimizer.lr='${base_lr}'`) is not a typo
    written = " ".join(overrides) + OmegaConf.to_yaml(cfg)
    added = {h: o for h, o in added.items() if not re.search(rf"\$\{{\s*{re.escape(h)}\b", written)}
    if not added:
        return []
    rest = [o for o in overrides if override_key(o).split(".", 1)[0] not in added]
    try:  # the config without them: which of them it has already (`+loader.x=1`, `++seed=1`)
        base = hydra.compose(config_name="config", overrides=rest)
    except HydraException:
        return []  # nothing to compare with: the config's own checks see what they add
    known = sorted(set(base) | own)
    return [
        _top_level_problem(head, override, known)
        for head, override in sorted(added.items())
        if head not in base
    ]


# Hydra prints a failed composition itself and exits 1, unless this is "1" (or a debugger
# runs): then it raises the error for the entry point to report. _OURS marks it as set by
# run_checked, in the processes a launcher starts too, so that `composed()` unsets it.
_FULL_ERROR = "HYDRA_FULL_ERROR"
_OURS = "BATCHFIT_HYDRA_FULL_ERROR"


def run_entry_point(main: Callable[[], object]) -> None:
    """The ending of `python -m search`, `search.fit` and `train`: what the imports made lives
    as long as the process, so it goes out of the collector's reach (a full collection, and
    the interpreter's at exit, skips its ~560k objects: exit 3 s -> 0.4 s on 2 busy cores;
    nothing is trained yet, so no cycle is kept); then `main` under `run_checked`, an
    override of a key the config does not have said as every config error is."""
    gc.freeze()
    try:
        run_checked(main)
    except ConfigError as error:
        config_error(Console(stderr=True), error)


def run_checked(main: Callable[[], object]) -> None:
    """Run the @hydra.main `main`; an override of a key the config does not have
    (`search.memory_budgt=100MiB`) raises a ConfigError with the closest key instead of
    Hydra's "To append to your config use +search.memory_budgt=100MiB", which only leads
    to the same typo, added. Hydra's other errors are reported as Hydra reports them.
    `main` calls `composed()` first, which hands its own errors back to Hydra."""
    previous = os.environ.get(_FULL_ERROR)
    user_set = previous == "1" and _OURS not in os.environ
    if not user_set:  # _OURS keeps the user's own value (or none: "") to give back
        os.environ.update({_FULL_ERROR: "1", _OURS: previous or ""})
    try:
        main()
    except HydraException as error:
        swept = _swept_in_one_run(error, _entry_point(main))
        if swept:
            raise ConfigError(swept) from None
        problem = _missing_key(error) or _missing_option(error) or _unparsable(error)
        if problem is not None:
            raise ConfigError([problem]) from None
        if user_set:
            raise
        _hydra_report(error)
    finally:
        composed()


def composed() -> None:
    """The config is composed: Hydra reports the entry point's errors again (run_checked),
    and HYDRA_FULL_ERROR is as the user had it. Called by the task, and before a multirun
    launches its jobs (`Composed`), so that neither the jobs nor a launcher's own errors
    see it."""
    previous = os.environ.pop(_OURS, None)
    if previous is None:
        return
    if previous:
        os.environ[_FULL_ERROR] = previous
    else:
        os.environ.pop(_FULL_ERROR, None)


class Composed(Callback):
    """Hydra callback: the config is composed once a run or a multirun starts (`composed`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        composed()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        composed()


def _hydra_report(error: HydraException) -> None:
    """What Hydra prints for a failed composition, and its exit status."""
    sys.stderr.write(f"{error}\n")
    if isinstance(error.__cause__, Exception):
        sys.stderr.write(f"{error.__cause__}\n")
    sys.exit(1)


# Hydra's flags that take a value as the next argument (`-cd DIR`): not overrides.
_VALUED_FLAGS = {
    "-cd", "--config-dir", "-cn", "--config-name", "-cp", "--config-path", "-c", "--cfg",
    "-p", "--package", "-i", "--info", "--experimental-rerun",
}  # fmt: skip


def _command_line() -> list[str]:
    """The overrides of sys.argv (Hydra's flags and their values left out)."""
    overrides, flag_value = [], False
    for arg in sys.argv[1:]:
        if flag_value:
            flag_value = False
        elif arg.startswith("-"):
            flag_value = arg in _VALUED_FLAGS
        else:
            overrides.append(arg)
    return overrides


def _missing_key(error: HydraException) -> str | None:
    """batchfit's message for Hydra's "Could not override 'KEY'" of a key the config does
    not have, with the closest key of the config composed without it; None for any other
    failure, or when the config does not compose without it either."""
    if not (
        isinstance(error, ConfigCompositionException)
        and isinstance(error.__cause__, ConfigAttributeError | ConfigKeyError)
    ):
        return None
    overrides = _command_line()
    failed = [
        o
        for o in overrides
        if not o.startswith(("+", "~")) and f"'{override_key(o)}'" in str(error)
    ]
    if not failed:
        return None
    override = failed[0]
    key, value = override_key(override), override.split("=", 1)[1]
    try:  # Hydra has let go of its config search path: the entry points' conf/ again
        with hydra.initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = hydra.compose("config", overrides=[o for o in overrides if o != override])
    except HydraException:
        return None
    close = difflib.get_close_matches(key, _all_keys(cfg), n=1)
    if close:
        fix = f"did you mean {close[0]}? ({close[0]}={value})"
    else:
        fix = "check its spelling (`--cfg job` prints the config)"
    return f"{override}: {key} is not a key of the config; {fix}"


def _entry_point(main: Callable[[], object]) -> str:
    """The `python -m` name of an entry point's main: `batchfit.search.fit.__main__` (where
    @hydra.main's wrapper keeps its function's module) -> `search.fit`."""
    module = getattr(main, "__module__", "") or ""
    return module.removeprefix("batchfit.").removesuffix(".__main__") or "train"


def _swept_in_one_run(error: HydraException, entry: str) -> list[str]:
    """batchfit's message for Hydra's "Ambiguous value for argument 'trainer.batch_size=
    32,64'" (or "Sweep parameters ... requires --multirun", of choice(...) or range(...)):
    a key given several values in a command that runs once. Hydra's advice is Hydra's
    (`key=[value1,value2]`, `--multirun`); batchfit's says what each reading is here: a key
    that holds a list takes brackets, and for any other, a search is search.params and
    several runs are `python -m train --multirun`. No problem for any other failure."""
    if not isinstance(error, ConfigCompositionException) or not str(error).startswith(
        ("Ambiguous value for argument", "Sweep parameters")
    ):
        return []
    overrides = _command_line()
    swept = _sweeps(overrides)
    if not swept:
        return []
    lists = _list_keys([key for key, _ in swept.values()], [o for o in overrides if o not in swept])
    # a comma list for a key that holds a list: the brackets were left out
    bracketed = {
        o: f"{key}=[{o.split('=', 1)[1]}]"
        for o, (key, comma) in swept.items()
        if comma and key in lists
    }
    problems = [
        f"{o}: {swept[o][0]} holds a list, which Hydra reads in brackets (without them, a comma "
        f"list is several runs' values); write {fixed}"
        for o, fixed in bracketed.items()
    ]
    several = {o: swept[o] for o in swept if o not in bracketed}
    if several:
        problems.append(_several_values(several, bracketed, entry))
    return problems


def _sweeps(overrides: list[str]) -> dict[str, tuple[str, bool]]:
    """The overrides Hydra reads as a sweep (`k=1,2`, `k=choice(1,2)`, `k=range(1,4)`), each
    with its key and whether it is a plain comma list."""
    parser = OverridesParser.create()
    swept = {}
    for override in overrides:
        try:
            parsed = parser.parse_override(override)
        except HydraException:
            continue
        if parsed.is_sweep_override() and not parsed.is_hydra_override():
            comma = parsed.value_type == ValueType.SIMPLE_CHOICE_SWEEP
            swept[override] = (override_key(override), comma)
    return swept


def _several_values(
    swept: dict[str, tuple[str, bool]], bracketed: dict[str, str], entry: str
) -> str:
    """`trainer.batch_size=32,64 gives a key several values ...: python -m search ...
    '++search.params={trainer.batch_size:"choice(32,64)"}'; ... python -m train --multirun
    ...`: the commands are the user's, the rest of it as typed (`bracketed`: as fixed)."""
    args = [bracketed.get(arg, arg) for arg in sys.argv[1:]]
    space = []
    for override, (key, comma) in swept.items():
        value = override.split("=", 1)[1]
        value = f"choice({value})" if comma else value
        quote = "'" if '"' in value else '"'
        space.append(f"{key}:{quote}{value}{quote}")
    searched = [a for a in args if a not in swept] + [f"++search.params={{{','.join(space)}}}"]
    search = "search.fit" if entry == "search.fit" else "search"
    keys = "a key" if len(swept) == 1 else "keys"
    return (
        f"{', '.join(swept)} gives {keys} several values, which python -m {entry} takes only "
        f"in search.params or with --multirun: to search over them, give them to "
        f"search.params (this space alone): python -m {search} {shlex.join(searched)}; to "
        f"train once with each, use --multirun: python -m train --multirun {shlex.join(args)}"
    )


def _list_keys(keys: list[str], rest: list[str]) -> set[str]:
    """Which of `keys` hold a list in the config composed from the `rest` of the command
    line (none when it does not compose)."""
    try:  # Hydra has let go of its config search path: the entry points' conf/ again
        with hydra.initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = hydra.compose("config", overrides=rest)
    except HydraException:
        return set()
    return {key for key in keys if isinstance(OmegaConf.select(cfg, key, default=None), ListConfig)}


def _missing_option(error: HydraException) -> str | None:
    """batchfit's message for Hydra's "Could not find 'experiment/resnt'" (a group option
    that does not exist, typed on the command line): the override, the closest option and
    the others; None for any other failure."""
    if not isinstance(error, MissingConfigException) or not error.options:
        return None
    group, _, name = str(error.missing_cfg_file or "").rpartition("/")
    typed = [o for o in _command_line() if "=" in o and override_key(o) == group]
    if not group or not typed:
        return None
    override = typed[-1]
    close = difflib.get_close_matches(name, list(error.options), n=1)
    prefix = override.split(group, 1)[0]  # `+` for a group the defaults do not list
    fix = f"did you mean {close[0]}? ({prefix}{group}={close[0]}); " if close else ""
    return (
        f"{override}: the {group} group has no option {name!r}; {fix}its options: "
        f"{', '.join(error.options)}"
    )


def _unparsable(error: HydraException) -> str | None:
    """batchfit's message for an override Hydra's grammar cannot read (a value with
    non-ASCII letters or spaces, unquoted): which one, and the quoting that reads."""
    if not isinstance(error, OverrideParseException):
        return None
    parser = OverridesParser.create()
    for override in _command_line():
        try:
            parser.parse_overrides([override])
        except OverrideParseException as failed:
            key, _, value = override.partition("=")
            quote = '"' if "'" in value else "'"
            reason = str(failed).strip().splitlines()[0]
            return (
                f"{override}: Hydra's override grammar cannot read it ({reason}); quote the "
                f"value: {key}={quote}{value}{quote}"
            )
    return None


def _all_keys(cfg: Mapping, prefix: str = "") -> list[str]:
    """Every key of `cfg`, dotted: `search.memory_budget` (a value still to give, `???`,
    is a key too: reading it would raise)."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    keys = []
    for name, value in cfg.items():
        keys.append(f"{prefix}{name}")
        if isinstance(value, Mapping):
            keys += _all_keys(value, f"{prefix}{name}.")
    return keys
