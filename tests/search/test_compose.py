"""search/core/compose.py: --config-dir and hydra.searchpath become one explicit
`hydra.searchpath=[file:///abs,...]` override, which hydra.compose honours.

The fake Hydra configs mimic what `HydraConfig.get()` holds for
`python -m search --config-dir extra 'hydra.searchpath=[file://myconf]' a=2` (checked
against a real run: `runtime.config_sources` lists the --config-dir as provider
`command-line` and the primary config dir as `main`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf

from batchfit.search.core.compose import search_path, task_overrides

REPO = Path(__file__).resolve().parents[2]


def _hydra_cfg(main: str, config_dir: str | None, hydra: list[str], task: list[str]) -> DictConfig:
    sources = [
        {"provider": "hydra", "path": "hydra.conf", "schema": "pkg"},
        {"provider": "main", "path": main, "schema": "file"},
    ]
    if config_dir is not None:
        sources.append({"provider": "command-line", "path": config_dir, "schema": "file"})
    sources.append({"provider": "schema", "path": "", "schema": "structured"})
    return OmegaConf.create(
        {
            "runtime": {"config_sources": sources},
            "overrides": {"hydra": [*hydra, "hydra.run.dir=/x", "hydra.mode=RUN"], "task": task},
        }
    )


def _entries(override: str) -> list[str]:
    """The list an override sets, as Hydra's own parser reads it."""
    return [str(e) for e in OverridesParser.create().parse_override(override).value()]


def test_config_dir_and_searchpath_become_absolute_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _hydra_cfg(
        main=str(REPO / "conf"),
        config_dir="extra",  # relative to the working directory, as typed
        hydra=["hydra.searchpath=[file://myconf,'file:///opt/my conf',pkg://other.conf]"],
        task=["a=2", "model=tiny"],
    )
    expected = [
        f"file://{tmp_path}/extra",
        f"file://{tmp_path}/myconf",
        "file:///opt/my conf",
        "pkg://other.conf",
    ]
    assert search_path(cfg) == expected
    overrides = task_overrides(cfg)
    assert overrides[1:] == ["a=2", "model=tiny"]
    assert overrides[0] == (
        f"hydra.searchpath=[file://{tmp_path}/extra,file://{tmp_path}/myconf,"
        "'file:///opt/my conf',pkg://other.conf]"
    )
    assert _entries(overrides[0]) == expected  # the quoting survives Hydra's parser


def test_the_primary_config_dir_given_as_config_dir_is_not_repeated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _hydra_cfg(main=str(tmp_path / "conf"), config_dir="conf", hydra=[], task=["a=2"])
    assert search_path(cfg) == []
    assert task_overrides(cfg) == ["a=2"]  # nothing to add


def test_a_dir_given_twice_is_listed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = _hydra_cfg(
        main=str(REPO / "conf"),
        config_dir=str(tmp_path / "extra"),
        hydra=["hydra.searchpath=[file://extra,extra,file://./extra/,'file://~/conf']"],
        task=[],
    )
    assert search_path(cfg) == [f"file://{tmp_path}/extra", f"file://{tmp_path}/home/conf"]


def test_the_override_finds_a_group_option_only_the_user_dir_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end with Hydra: a model option that exists only in a user's config dir (named
    relative to the working directory, with a space) composes with the produced override."""
    (tmp_path / "my conf" / "model").mkdir(parents=True)
    (tmp_path / "my conf" / "model" / "tiny.yaml").write_text(
        "_target_: batchfit.train.models.small_cnn\nwidth: 2\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = _hydra_cfg(
        main=str(REPO / "conf"),
        config_dir=None,
        hydra=["hydra.searchpath=['file://my conf']"],
        task=["model=tiny", "data=digits"],
    )
    overrides = task_overrides(cfg)
    monkeypatch.chdir(REPO)  # a trial composes wherever the process is
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        composed = compose(config_name="config", overrides=overrides)
        assert composed.model == {"_target_": "batchfit.train.models.small_cnn", "width": 2}
        with pytest.raises(MissingConfigException, match="model/tiny"):
            compose(config_name="config", overrides=overrides[1:])  # without the search path
