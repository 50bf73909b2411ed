"""No import circles among the bundle's own modules.

The graph is read from the source with ``ast`` (nothing is imported). Every import counts, wherever it sits: one
deferred into a function body only postpones the circle to the first call, and one under ``if TYPE_CHECKING:`` is
still a dependency in both directions. A package's ``__init__`` is a node of its own (named by the package), so a
submodule that imports a name from its own package's ``__init__`` while that ``__init__`` imports the submodule is a
circle too: such a submodule names the module that defines the name instead.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("aggregators", "benchmarks", "controllers", "data_prep", "examples", "jobs", "lightning_modules")
#: The folder whose packages are installed (and shipped) as top-level packages of their own.
EXAMPLES = "examples"


def module_name(path: Path, root: Path) -> str:
    """``aggregators/fedavg.py`` -> ``aggregators.fedavg``; ``aggregators/__init__.py`` -> ``aggregators``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def bundle_modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Every module of the installed packages, by dotted name. The exported ``jobs/<name>/app`` folders are copies
    the builder writes for NVFlare, not modules of the bundle."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path.relative_to(root).parts[:3:2] == ("jobs", "app"):  # jobs/<name>/app/...
                continue
            modules[module_name(path, root)] = path
    return modules


def installed_modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """`bundle_modules`, with each package under ``examples/`` named as it is imported: pyproject installs
    ``examples/genomics`` as the top-level package ``genomics`` (and a job ships ``examples/custom_model`` as
    ``custom_model``), so an import of ``genomics.data`` is an edge to ``examples/genomics/data.py``."""
    modules = bundle_modules(root, [package for package in packages if package != EXAMPLES])
    if EXAMPLES in packages:
        examples = root / EXAMPLES
        modules.update(bundle_modules(examples, sorted(p.parent.name for p in examples.glob("*/__init__.py"))))
    return modules


def _is_package(name: str, modules: Mapping[str, Path]) -> bool:
    return name in modules and modules[name].name == "__init__.py"


def _absolute_base(node: ast.ImportFrom, importer: str, modules: Mapping[str, Path]) -> str:
    """The module ``from <base> import ...`` names, with a relative base resolved against the importer."""
    if not node.level:
        return node.module or ""
    package = importer if _is_package(importer, modules) else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imported_modules(tree: ast.AST, importer: str, modules: Mapping[str, Path]) -> set[str]:
    """The bundle modules that ``importer``'s source imports, at any depth of its syntax tree."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_base(node, importer, modules)
            for alias in node.names:
                # ``from package import name`` loads the submodule when ``name`` is one, else the package itself.
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {name for name in found if name in modules}


#: A string that is a whole dotted name, optionally with ``:ATTR`` (``"pkg.mod"``, ``"pkg.mod.Class"``,
#: ``"pkg.mod:NAME"``).
DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(?:\.\w+)*(?::[\w.]+)?")


def _named_module(text: str, modules: Mapping[str, Path]) -> str | None:
    """The bundle module a string names: itself, the part before ``:`` (a registry or object path), or the part
    before the last dot (a class path); ``None`` for any other string."""
    if not DOTTED_NAME.fullmatch(text) or ("." not in text and ":" not in text):
        return None
    module = text.partition(":")[0]
    for candidate in (module, module.rpartition(".")[0]):
        if candidate in modules:
            return candidate
    return None


#: The calls whose first argument is a module to import.
IMPORTERS = {"import_module", "__import__"}


def _call_name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _docstrings(tree: ast.AST) -> set[int]:
    bodies = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, bodies) and node.body and isinstance(node.body[0], ast.Expr)
    }


def named_modules(tree: ast.AST, modules: Mapping[str, Path]) -> set[str]:
    """The bundle modules that ``tree`` names in strings, outside docstrings: the literal argument of
    ``import_module``/``__import__`` and every string that is a module's dotted name, ``module:ATTR`` (a registry)
    or ``module.Class`` (a class path NVFlare's config reads). Such a name is a dependency as real as an import."""
    docstrings = _docstrings(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node.func) in IMPORTERS and node.args:
            argument = node.args[0]
            if isinstance(argument, ast.Constant) and argument.value in modules:  # a top-level package's name
                found.add(argument.value)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            module = _named_module(node.value, modules)
            if module is not None:
                found.add(module)
    return found


def import_graph(modules: Mapping[str, Path], by_name: bool = False) -> dict[str, set[str]]:
    """Each module's imports; ``by_name``: also the modules it names in strings (`named_modules`)."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = imported_modules(tree, name, modules)
        if by_name:
            graph[name] |= named_modules(tree, modules) - {name}
    return graph


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, and modules that import themselves (Tarjan)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = lowlink[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                lowlink[node] = min(lowlink[node], lowlink[target])
            elif target in on_stack:
                lowlink[node] = min(lowlink[node], index[target])
        if lowlink[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def describe(cycle: list[str], graph: Mapping[str, set[str]]) -> str:
    """One line per circle: its modules and the imports that close it."""
    members = set(cycle)
    edges = [f"{source} -> {target}" for source in cycle for target in sorted(graph[source] & members)]
    return f"{' <-> '.join(cycle)}: {'; '.join(edges)}"


def test_the_bundle_has_no_import_circles() -> None:
    graph = import_graph(installed_modules(REPO))
    cycles = import_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(describe(cycle, graph) for cycle in cycles)


# --- the checker itself, on small synthetic packages, so that a silent checker cannot pass the test above ---


def _write_package(root: Path, files: Mapping[str, str]) -> dict[str, Path]:
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    return bundle_modules(root, packages=("pkg",))


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # a deferred (function-level) import closes the circle as surely as a module-level one
        (
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "from pkg.b import f\n",
                "pkg/b.py": "def f():\n    from pkg import a\n",
            },
            [["pkg.a", "pkg.b"]],
        ),
        # relative imports, and a three-module circle
        (
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "from .b import x\n",
                "pkg/b.py": "from . import c\n",
                "pkg/c.py": "import pkg.a\n",
            },
            [["pkg.a", "pkg.b", "pkg.c"]],
        ),
        # a submodule importing a re-export from its own package's __init__, which imports it
        ({"pkg/__init__.py": "from pkg.a import A\n", "pkg/a.py": "from pkg import B\nA = 1\n"}, [["pkg", "pkg.a"]]),
        # a module importing itself
        ({"pkg/__init__.py": "", "pkg/a.py": "def f():\n    from pkg.a import f\n"}, [["pkg.a"]]),
        # the package's __init__ importing its submodules, which import each other in one direction: no circle
        (
            {
                "pkg/__init__.py": "from pkg.a import A\nfrom pkg.b import B\n",
                "pkg/a.py": "A = 1\n",
                "pkg/b.py": "from pkg.a import A\nB = A\n",
            },
            [],
        ),
    ],
)
def test_the_checker_finds_exactly_the_circles(
    tmp_path: Path, files: dict[str, str], expected: list[list[str]]
) -> None:
    assert import_cycles(import_graph(_write_package(tmp_path, files))) == expected


def test_imports_resolve_to_the_module_that_runs(tmp_path: Path) -> None:
    """Relative imports against the importing package; ``from package import name`` to the submodule when ``name``
    is one, else to the package's ``__init__``; imports from outside the bundle are left out."""
    modules = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "import os\n",
            "pkg/sub/__init__.py": "from . import x\nfrom pkg.sub.x import X\n",
            "pkg/sub/x.py": "from .. import y\nX = 1\n",
            "pkg/y.py": "def f():\n    from .sub import X\n",
        },
    )
    assert import_graph(modules) == {
        "pkg": set(),
        "pkg.sub": {"pkg.sub.x"},
        "pkg.sub.x": {"pkg.y"},
        "pkg.y": {"pkg.sub"},
    }
