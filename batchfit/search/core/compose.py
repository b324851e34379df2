"""The overrides a trial and a rerun compose the config from: the command line's, with the
config search path made explicit.

`--config-dir DIR` and `hydra.searchpath=[...]` reach Hydra outside the task's overrides, so
a trial re-composed from those alone, or a printed rerun command, would not find a user's
own config groups. Both become one `hydra.searchpath=[file:///abs/DIR,...]` override here,
which `hydra.compose` honours like the command line.
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

from batchfit.common.overrides import override_key

SEARCHPATH_KEY = "hydra.searchpath"
_FILE = "file://"
_PLAIN = re.compile(r"[\w/.:@-]+")  # needs no quotes in Hydra's override grammar


def _absolute(entry: str) -> str:
    if entry.startswith(_FILE):
        return _FILE + str(Path(entry.removeprefix(_FILE)).expanduser().resolve())
    if "://" not in entry:  # a bare path
        return _FILE + str(Path(entry).expanduser().resolve())
    return entry  # pkg://...


def search_path(hydra_cfg: DictConfig) -> list[str]:
    """The user's config directories, absolute: --config-dir's, then hydra.searchpath's."""
    sources = hydra_cfg.runtime.config_sources
    primary = {Path(s.path).resolve() for s in sources if s.provider == "main"}
    entries = [
        _FILE + str(Path(source.path).resolve())
        for source in sources
        if source.provider == "command-line" and Path(source.path).resolve() not in primary
    ]
    for override in hydra_cfg.overrides.hydra:
        if override_key(override) == SEARCHPATH_KEY:
            parsed = OverridesParser.create().parse_override(override)
            entries += [_absolute(str(e)) for e in parsed.value()]
    return list(dict.fromkeys(entries))


def task_overrides(hydra_cfg: DictConfig) -> list[str]:
    """The command line's overrides, with the search path as one override in front."""
    overrides = list(hydra_cfg.overrides.task)
    entries = search_path(hydra_cfg)
    if entries:
        quoted = ",".join(e if _PLAIN.fullmatch(e) else f"'{e}'" for e in entries)
        overrides.insert(0, f"{SEARCHPATH_KEY}=[{quoted}]")
    return overrides
