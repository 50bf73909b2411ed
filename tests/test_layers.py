"""The bundle's packages form layers: a module imports only from its own package or from a lower layer.

The order (docs/design.md, "Layers"), bottom first:

=====  ===============================  ==================================================================
layer  packages                         what lives there
=====  ===============================  ==================================================================
0      ``aggregators``                  rules' math, typed hparams, the wire messages, every meta key, and
                                        what the layers above agree on: site sampling, the installed
                                        packages and HE context names, a run's files and how it ended
1      ``data_prep``                    datasets, partitions, site data configuration, genotype files
2      ``lightning_modules``            the site's runtime: client algorithms, the Lightning callback, state,
                                        the FedOpt step the sites take under secure aggregation
3      ``controllers`` | ``jobs`` |     server runtime | build time (settings, spec, NVFlare assembly) |
       ``examples``                     users' own models; each independent of the other two
4      ``benchmarks``                   harnesses over everything below, incl. the in-process federation
=====  ===============================  ==================================================================

Packages on one layer do not import each other: ``jobs`` (build time) and ``controllers`` (server runtime) are
independent, so neither can drag the other into a process that needs only one. The graph is the one
``tests/test_import_graph.py`` reads with ``ast``: every import counts, deferred or under ``TYPE_CHECKING``.
`JOB_API_CROSSINGS` lists, edge by edge, the one kind of import that crosses the order on purpose: the builder
constructs the server's NVFlare components, because NVFlare's job API serialises component *instances* (it reads each
one's class, module, source file and constructor arguments) and takes no import path. The server runtime never
imports build time. The test fails on any other crossing and on a listed one that no longer exists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tests.test_import_graph import EXAMPLES, REPO, import_graph, installed_modules

#: Bottom first; packages in one tuple share a layer and must not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("aggregators",),
    ("data_prep",),
    ("lightning_modules",),
    ("controllers", "jobs", "examples"),
    ("benchmarks",),
)
#: Top-level folders with Python files that are not packages of the bundle.
NOT_LAYERED = {
    "tests": "the suite imports every layer",
    "scripts": "the docs build's hook, run by mkdocs",
}
#: The crossings NVFlare's job API forces, each ``importer -> imported``: build time constructs the server's NVFlare
#: components (controller, test-set evaluator, the HE workflow's filters and site step) to write a job's config.
JOB_API_CROSSINGS: frozenset[str] = frozenset(
    {
        "jobs.assembly -> controllers.evaluator",
        "jobs.assembly -> controllers.fedalg_controller",
        "jobs.secure_aggregation -> controllers.he_fedopt",
        "jobs.secure_aggregation -> controllers.secagg",
        "jobs.secure_aggregation -> controllers.secagg_site",
        "jobs.secure_aggregation -> controllers.secure_aggregation",
    }
)


def layer_of(packages: Sequence[Sequence[str]] = LAYERS) -> dict[str, int]:
    return {package: level for level, members in enumerate(packages) for package in members}


def example_packages(root: Path = REPO) -> set[str]:
    """The packages under ``examples/``, imported by their own names (``genomics``, ``custom_model``)."""
    return {path.parent.name for path in (root / EXAMPLES).glob("*/__init__.py")}


def crossings(
    graph: Mapping[str, set[str]], layers: Sequence[Sequence[str]] = LAYERS, examples: frozenset[str] = frozenset()
) -> list[str]:
    """Every import from one package into another that is not on a lower layer, as ``importer -> imported``; the
    packages in ``examples`` count as the ``examples`` package."""
    level = layer_of(layers)

    def package(module: str) -> str:
        top = module.split(".")[0]
        return EXAMPLES if top in examples else top

    found = []
    for importer, imported in graph.items():
        source = package(importer)
        for target in imported:
            if package(target) != source and level[package(target)] >= level[source]:
                found.append(f"{importer} -> {target}")
    return sorted(found)


def layered_modules(root: Path = REPO) -> dict[str, Path]:
    return installed_modules(root, packages=[package for layer in LAYERS for package in layer])


def test_every_package_has_a_layer() -> None:
    """A new top-level package must be placed in the order (or named as not part of the bundle)."""
    tops = [path for path in REPO.iterdir() if path.is_dir() and not path.name.startswith(".")]
    folders = {path.name for path in tops if next(path.rglob("*.py"), None) is not None}
    assert folders - set(NOT_LAYERED) == set(layer_of()), "place every package in LAYERS"


def test_imports_follow_the_layers() -> None:
    found = set(crossings(import_graph(layered_modules()), examples=frozenset(example_packages())))
    allowed = JOB_API_CROSSINGS
    assert not found - allowed, "imports against the layer order:\n" + "\n".join(sorted(found - allowed))
    gone = "\n".join(sorted(allowed - found))
    assert not gone, "no longer imported, remove from JOB_API_CROSSINGS:\n" + gone


# --- the checker itself, on synthetic packages, so that a silent checker cannot pass the test above ---


def _graph(tmp_path: Path, files: Mapping[str, str], packages: Sequence[str]) -> dict[str, set[str]]:
    for relative, source in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    return import_graph(installed_modules(tmp_path, packages=packages))


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # downward imports, at module level or deferred, are allowed
        ({"low/__init__.py": "", "top/a.py": "def f():\n    from low import x\n"}, []),
        # an upward import, even deferred into a function, crosses
        ({"low/a.py": "def f():\n    import top.b\n", "top/b.py": ""}, ["low.a -> top.b"]),
        # packages on one layer are independent: a sideways import crosses, as a circle would not need to
        ({"left/a.py": "from right.b import y\n", "right/b.py": "y = 1\n"}, ["left.a -> right.b"]),
        # a relative import stays inside its package
        ({"top/__init__.py": "", "top/a.py": "from . import b\n", "top/b.py": ""}, []),
        # an example package is imported by its own name and sits on the examples' layer
        (
            {"left/a.py": "import demo.model\n", "examples/demo/__init__.py": "", "examples/demo/model.py": ""},
            ["left.a -> demo.model"],
        ),
    ],
)
def test_the_checker_finds_exactly_the_crossings(tmp_path: Path, files: Mapping[str, str], expected: list[str]) -> None:
    layers = (("low",), ("left", "right", EXAMPLES), ("top",))
    graph = _graph(tmp_path, files, [package for layer in layers for package in layer])
    assert crossings(graph, layers, frozenset(example_packages(tmp_path))) == expected
