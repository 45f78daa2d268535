"""The package's layers import only downward (core → models → tasks → train → integrations →
tools → cli) and no module imports itself round a circle. Read from the source with ``ast``: imports
inside functions count too, and so do imports under ``if TYPE_CHECKING:`` (an annotation that
names a module is a dependency on it). Method names are written as strings only in the
registry and in the config's default (no string tests on them elsewhere)."""

from __future__ import annotations

import ast
from pathlib import Path

import daca
from daca.train.methods import METHODS

ROOT = Path(daca.__file__).resolve().parent
LAYERS = ["core", "models", "tasks", "train", "integrations", "tools", "cli"]
# Top-level modules outside the sub-packages: the package itself re-exports the core; the names
# of the shipped models are data the configuration reads without importing the model loader.
TOP_LEVEL = {"daca": "core", "daca.shipped": "models"}


def _module_name(path: Path) -> str:
    parts = ("daca", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _in_daca(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] == "daca"


def _imported(tree: ast.AST, known: set[str]) -> set[str]:
    """The daca modules a module's code imports (a name imported from a package is its
    submodule when one exists by that name)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if _in_daca(a.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _in_daca(node.module):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {
        name: _imported(ast.parse(path.read_text()), known) - {name}
        for name, path in modules.items()
    }


def layer(module: str) -> int:
    if module in TOP_LEVEL:
        return LAYERS.index(TOP_LEVEL[module])
    return LAYERS.index(module.split(".")[1])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_every_module_sits_in_a_layer():
    for name in import_graph():
        assert layer(name) >= 0, name


def test_no_module_imports_from_a_higher_layer():
    upward = [
        f"{name} ({LAYERS[layer(name)]}) imports {target} ({LAYERS[layer(target)]})"
        for name, targets in import_graph().items()
        for target in sorted(targets)
        if layer(target) > layer(name)
    ]
    assert upward == []


def test_core_imports_nothing_of_daca_outside_core():
    outside = {
        (name, target)
        for name, targets in import_graph().items()
        if name.startswith("daca.core")
        for target in targets
        if not target.startswith("daca.core")
    }
    assert outside == set()


def test_config_does_not_import_the_model_loader():
    assert "daca.models.loading" not in import_graph()["daca.train.config"]
    assert "daca.models" not in import_graph()["daca.train.config"]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_type_checking_imports_are_edges():
    source = "if TYPE_CHECKING:\n    from daca.tasks import Task\n"
    assert _imported(ast.parse(source), {"daca.tasks"}) == {"daca.tasks"}


# Where a method's name may be a string: its registry entry, and the config's default method.
METHOD_NAME_HOMES = {"daca.train.methods", "daca.train.config"}


def method_name_literals(source: str) -> list[str]:
    """The string constants of ``source`` that are a registered method's name."""
    return [
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in METHODS
    ]


def test_method_names_are_strings_only_in_the_registry_and_the_config_default():
    found = {
        name: literals
        for name, path in _modules().items()
        if (literals := method_name_literals(path.read_text()))
    }
    elsewhere = {name: v for name, v in found.items() if name not in METHOD_NAME_HOMES}
    assert elsewhere == {}
    assert sorted(found["daca.train.methods"]) == sorted(METHODS)  # one entry per method
    assert found["daca.train.config"] == [found["daca.train.config"][0]]  # the default, once


def test_the_literal_finder_finds_a_method_name():
    name = next(iter(METHODS))
    assert method_name_literals(f"if cfg.method == {name!r}:\n    pass") == [name]
    assert method_name_literals(f"x = 'not {name}'") == []
