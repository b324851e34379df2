"""The shape of the code, checked so that it does not drift: the packages import downwards only
of batchfit/ (common <- tracking <- train <- search <- the public modules of batchfit/'s root:
the API, the integrations, the command), and so do the layers within search/ and train/
(LAYERS); no module imports itself back through others (imports inside functions and under
TYPE_CHECKING count: a cycle hidden in a function is still a cycle a reader must hold in their
head); and the files and folders stay a size a newcomer can read (SIZE_CAPS)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "batchfit"
# bottom to top: each imports only those before it; "batchfit" is the package's root modules
# (the public surface), named here `batchfit.MODULE`, the others by their path below batchfit/
PACKAGES = ("common", "tracking", "train", "search", "batchfit")
# Per package: (lines per file, modules per folder besides __init__.py and __main__.py)
SIZE_CAPS = {
    "train": (600, 16),
    "search": (600, 12),
    "tracking": (600, 16),
    "common": (600, 12),
    "bench": (600, 16),
    "batchfit": (600, 12),  # the root's modules only: the public surface
}
# Each package's layers, bottom to top: a module imports from its own layer and those below it
# only. A layer holds wings (subpackages) and modules of the package's root, by name; modules of
# one layer may import each other (without cycles). Entry points (__main__) sit above every
# layer and may import any.
LAYERS = {
    "search": (
        ("core",), ("sampling",), ("storage",), ("fit",), ("results",), ("trial",), ("study",),
    ),
    "train": (
        ("device",),  # the GPU table, the device spec, allocator and cuDNN settings, byte sizes
        # the basics: settings, data, models, tasks, batches, builders
        ("params", "config", "precision", "tasks", "data", "models", "lr", "plan",
         "language", "batches", "checkpointing", "build", "model_file"),
        ("measure", "parallel"),  # the instruments and the ranks they read across
        ("step",),  # one optimizer step, the hooks, the run's result
        ("memory",),  # the step predicted
        ("loop",),  # the step repeated
        ("workload",),  # a config's data, builders and predictor, shared
        ("launch",),  # above the loop: the ranks of a distributed run, the speed probe
        ("run",),  # plan, check, build and fit one config
    ),
}  # fmt: skip


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES[:-1]:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    for path in sorted(PACKAGE.glob("*.py")):
        modules[f"batchfit.{path.stem}".removesuffix(".__init__")] = path
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
            inner = candidate.removeprefix("batchfit.")  # batchfit.train.run is train.run
            if inner.split(".")[0] in PACKAGES[:-1]:
                candidate = inner
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
    assert "train.launch.distributed" in GRAPH["train.run"]  # imported inside run()
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


def _unit(name: str) -> str | None:
    """The wing or root module that module `name` belongs to (None for an entry point or the
    package itself)."""
    package, *rest = name.split(".")
    if package not in LAYERS or not rest or rest[-1] == "__main__":
        return None
    return rest[0]


def _layer(package: str, unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS[package]) if unit in layer)


def _against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for name, others in sorted(graph.items()):
        package, unit = name.split(".")[0], _unit(name)
        for other in sorted(others):
            theirs = _unit(other)
            if unit is None or theirs is None or other.split(".")[0] != package:
                continue
            if _layer(package, theirs) > _layer(package, unit):
                found.append(f"{name} ({unit}) imports {other} ({theirs})")
    return found


def test_the_layer_check_sees_an_import_against_the_order() -> None:
    upward = {
        "search.fit.layouts": {"search.study.validate", "search.core.record"},
        "train.memory.predict": {"train.loop", "train.step", "train.device.spec"},
        "train.measure.noise": {"train.parallel.ranks"},  # one layer: allowed
    }
    assert _against_the_layers(upward) == [
        "search.fit.layouts (fit) imports search.study.validate (study)",
        "train.memory.predict (memory) imports train.loop (loop)",
    ]
    entry = {"search.fit.__main__": {"search.study.validate"}}  # entry points sit above all
    assert _against_the_layers(entry) == []


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_every_module_is_in_a_layer(package: str) -> None:
    named = {unit for layer in LAYERS[package] for unit in layer}
    units = {_unit(n) for n in MODULES if n.startswith(package + ".")} - {None}
    assert not units - named, f"{package}/ modules in no layer of LAYERS: {units - named}"
    assert not named - units, f"LAYERS names what {package}/ does not have: {named - units}"


def test_layers_within_a_package_import_downwards_only() -> None:
    against = _against_the_layers(GRAPH)
    assert not against, "imports against the layers (LAYERS):\n" + "\n".join(against)


@pytest.mark.parametrize("package", sorted(SIZE_CAPS))
def test_files_and_folders_stay_readable(package: str) -> None:
    max_lines, max_modules = SIZE_CAPS[package]
    root = {"bench": REPO / "bench", "batchfit": PACKAGE}.get(package, PACKAGE / package)
    files = root.glob("*.py") if package == "batchfit" else root.rglob("*.py")
    too_long = {
        str(path.relative_to(REPO)): n
        for path in files
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > max_lines
    }
    assert not too_long, f"files of {package}/ over {max_lines} lines: {too_long}"
    crowded = {
        str(folder.relative_to(REPO)): n
        for folder in [root, *(p for p in root.rglob("*") if p.is_dir() and package != "batchfit")]
        if folder.name != "__pycache__"
        and (n := len([p for p in folder.glob("*.py") if not p.name.startswith("__")]))
        > max_modules
    }
    assert not crowded, f"folders of {package}/ with over {max_modules} modules: {crowded}"


def test_every_module_opens_with_a_docstring() -> None:
    missing = [
        str(path.relative_to(REPO))
        for path in MODULES.values()
        if not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not missing, f"modules without a docstring: {missing}"
