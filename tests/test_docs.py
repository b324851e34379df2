"""The documentation: the site (mkdocs.yml, docs/) builds with --strict and no warning, every
page is in its navigation, the README stays a short first page, and every source path the
README or a page names exists. What the pages' commands do is tests/test_readme.py's and
tests/test_guide.py's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README_MAX_BYTES = 15_000  # "under 15 KB", with room to spare below 15 KiB
# A path as the docs write one: folders, then a file with its extension (train/loop.py,
# conf/search/default.yaml, .ci/run is not one); a glob or a placeholder (<name>) is not.
PATH = re.compile(r"(?<![\w/.<*-])((?:\.?[a-z_][\w.-]*/)+[\w-]+\.(?:py|yaml|sh|csv|md|toml))\b")
# Paths the docs name that are not files of this repository: a user's project (the guide's
# files, written where its blocks say), another tool's files.
NOT_OURS = ("myproject/", "myconf/", "c10/", "hydra/", "mlruns/", ".hydra/", ".submitit/")


def _nav_pages(nav: list) -> list[str]:
    """The pages of mkdocs.yml's nav, sections flattened."""
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _mkdocs_config() -> dict:
    """mkdocs.yml, whose tags (!ENV, !relative) plain YAML does not know, read as plain."""
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return yaml.load((REPO / "mkdocs.yml").read_text(), Loader=loader)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    # --strict turns MkDocs's warnings (a broken link or anchor, a page missing from the nav)
    # into a failed build; a warning printed without failing it fails here too.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "mlflow-runs.png").is_file()  # the README's pictures, on the site too


def test_every_page_is_in_the_nav() -> None:
    nav = _nav_pages(_mkdocs_config()["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert len(pages) >= 10, pages  # the glob found the pages
    assert sorted(nav) == pages, f"in docs/ but not the nav: {set(pages) - set(nav)}"


def test_the_readme_is_short_and_links_the_guides() -> None:
    readme = (REPO / "README.md").read_text()
    size = len(readme.encode())
    assert size < README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/"
    # Relative links, so that they work on GitHub as on the site; every guide is one.
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)(?:#[\w-]+)?\)", readme))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert linked == pages, f"pages the README does not link: {pages - linked}"
    for picture in re.findall(r"\]\((docs/[\w.-]+\.png)\)", readme):
        assert (REPO / picture).is_file(), picture
    # The README is not a page of the site, so the build does not check its anchors: here,
    # with the slugs the site and GitHub both give a heading.
    for page, anchor in re.findall(r"\]\(docs/([\w-]+\.md)#([\w-]+)\)", readme):
        headings = re.findall(r"^#+ (.+)$", (DOCS / page).read_text(), re.M)
        assert anchor in {slugify(h, "-") for h in headings}, f"docs/{page}#{anchor}"


def test_every_path_the_docs_name_exists() -> None:
    named = {}
    for page in [REPO / "README.md", REPO / "bench" / "README.md", *DOCS.glob("*.md")]:
        for path in PATH.findall(page.read_text()):
            if not path.startswith(NOT_OURS):
                named.setdefault(path, page.relative_to(REPO).as_posix())
    assert len(named) >= 30, named  # the pattern found the paths
    # A path in a page resolves from the repository root, or from its bench/ folder for
    # bench/README.md's own scripts.
    missing = {
        path: page
        for path, page in named.items()
        if not (REPO / path).exists() and not (REPO / Path(page).parent / path).exists()
    }
    assert not missing, f"paths the docs name that do not exist (path: page): {missing}"


def _layout() -> list[str]:
    """The paths of the Layout tree in docs/design.md: each entry's name after its parents'
    (two spaces of indent a level); lines indented past the names continue a description."""
    design = (DOCS / "design.md").read_text()
    tree = design.split("## Layout\n", 1)[1].split("```\n", 2)[1]
    paths, parents = [], []
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if indent >= 16:  # a description's second line
            continue
        entry = re.match(r"^( *)(\S+)(?:  |$)", line)
        assert entry, f"not an entry of the Layout: {line!r}"
        parents = parents[: indent // 2] + [entry.group(2)]
        paths.append("".join(parents))
    return paths


def test_the_layout_matches_the_tree() -> None:
    paths = _layout()
    assert "batchfit/train/memory/predict.py" in paths, paths
    assert "batchfit/common/checks.py" in paths, paths
    ignored = ("mlruns/",)  # run output, not in a fresh checkout
    missing = [p for p in paths if not (REPO / p).exists() and not p.startswith(ignored)]
    assert not missing, f"the Layout (docs/design.md) names what is not there: {missing}"
    # Every folder of the code is in it; modules, at the level of the main ones.
    folders = [
        f"{p.relative_to(REPO).as_posix()}/"
        for package in ("batchfit/common", "batchfit/train", "batchfit/search", "batchfit/tracking")
        for p in [REPO / package, *(REPO / package).iterdir()]
        if p.is_dir() and (p / "__init__.py").is_file()
    ]
    assert not [f for f in folders if f not in paths], folders


def test_the_extras_are_listed_alike_where_an_install_is_told() -> None:
    """Every extra of pyproject.toml is named in the README and on the site's install page,
    each with the packages it brings: the README's `llm` listed bitsandbytes where the site
    did not, and docs/metrics.md installs `.[energy]`, which the README's list lacked."""
    import tomllib
    from packaging.requirements import Requirement

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for page in ("README.md", "docs/index.md"):
        text = " ".join((REPO / page).read_text().split())
        for name, requirements in extras.items():
            assert f'".[{name}]"' in text, (page, name)
            if name in ("dev", "docs"):
                continue  # "all of them", "MkDocs": a family, not each package
            said = text.split(f'".[{name}]"', 1)[1][:160]
            for requirement in requirements:
                package = Requirement(requirement).name.split("-")[0].lower()
                assert package in said.lower().replace("-", "").replace("_", "") or (
                    name == "cluster" and package in ("hydra", "submitit", "psycopg")
                ), (page, name, package, said)
