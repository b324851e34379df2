"""The shape of the code, checked so that it does not drift: the layers import downwards only
(tracking <- train <- search), no module imports itself back through others (imports inside
functions and under TYPE_CHECKING count: a cycle hidden in a function is still a cycle a
reader must hold in their head), and train/'s files and folders stay a size a newcomer can
read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("tracking", "train", "search")  # bottom to top: each imports only those before it
MAX_LINES = 600  # per file of train/
MAX_MODULES = 16  # per folder of train/, besides __init__.py and __main__.py


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project's modules that `name` imports, anywhere in its file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from train import loop` imports the module train.loop
            candidates = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in MODULES:
                candidate = candidate.rpartition(".")[0]
            # a package's own __init__ is not an edge back from its modules
            if candidate and candidate != name and not name.startswith(candidate + "."):
                found.add(candidate)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_graph_sees_imports_inside_functions_and_type_checking_blocks() -> None:
    """The checks below are only as good as the graph: a known lazy import is in it."""
    assert "train.parallel.distributed" in GRAPH["train.run"]  # imported inside run()
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back() -> None:
    cycles = _cycles(GRAPH)
    described = [
        " -> ".join(f"{m} (imports {sorted(GRAPH[m] & set(c))})" for m in c) for c in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(described)


@pytest.mark.parametrize("package", PACKAGES)
def test_layers_import_downwards_only(package: str) -> None:
    above = PACKAGES[PACKAGES.index(package) + 1 :]
    upward = sorted(
        f"{name} imports {other}"
        for name, others in GRAPH.items()
        if name.split(".")[0] == package
        for other in others
        if other.split(".")[0] in above
    )
    assert not upward, f"{package}/ must not import from {', '.join(above)}/: {upward}"


def test_train_files_and_folders_stay_readable() -> None:
    too_long = {
        str(path.relative_to(REPO)): n
        for path in (REPO / "train").rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not too_long, f"files of train/ over {MAX_LINES} lines: {too_long}"
    crowded = {
        str(folder.relative_to(REPO)): n
        for folder in [REPO / "train", *(p for p in (REPO / "train").rglob("*") if p.is_dir())]
        if folder.name != "__pycache__"
        and (n := len([p for p in folder.glob("*.py") if not p.name.startswith("__")]))
        > MAX_MODULES
    }
    assert not crowded, f"folders of train/ with over {MAX_MODULES} modules: {crowded}"


def test_every_module_opens_with_a_docstring() -> None:
    missing = [
        str(path.relative_to(REPO))
        for path in MODULES.values()
        if not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not missing, f"modules without a docstring: {missing}"
