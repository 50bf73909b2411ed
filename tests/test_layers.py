"""The bundle's packages form layers: a module imports only from its own package or from a lower layer.

The order (docs/design.md, "Layers"), bottom first:

=====  ===============================  ==================================================================
layer  packages                         what lives there
=====  ===============================  ==================================================================
0      ``aggregators.contracts``        what the layers above agree on: job settings, typed hparams, the
                                        wire messages, every meta key, site sampling, the installed
                                        packages and HE context names, a run's files and how it ended,
                                        the egress declarations and the sites' gate that enforces them
1      ``aggregators``                  the rules' math (``aggregators.contracts`` excluded)
2      ``data_prep``                    datasets, partitions, site data configuration, genotype files
3      ``lightning_modules``            the site's runtime: client algorithms, the Lightning callback, state,
                                        the FedOpt step the sites take under secure aggregation
4      ``controllers`` | ``jobs`` |     server runtime | build time (settings, spec, NVFlare assembly) |
       ``examples``                     users' own models; each independent of the other two
5      ``benchmarks``                   harnesses over everything below, incl. the in-process federation
=====  ===============================  ==================================================================

Packages on one layer do not import each other: ``jobs`` (build time) and ``controllers`` (server runtime) are
independent, so neither can drag the other into a process that needs only one. A package inside another (the
contracts inside ``aggregators``) is a layer of its own; a module belongs to the deepest layered package holding it.
The graph is the one ``tests/test_import_graph.py`` reads with ``ast``: every import counts, deferred or under
``TYPE_CHECKING``, and so does every module named in a string (``import_module("...")``, a registry's
``"package.module:NAME"``, a class path ``"package.module.Class"``): a layer that looks a module up by name depends on
it as surely as one that imports it, so the bottom layer names its registries by a name the layer owning them resolves.
`JOB_API_CROSSINGS` lists, edge by edge, the one kind of import that crosses the order on purpose: the builder
constructs the server's NVFlare components, because NVFlare's job API serialises component *instances* (it reads each
one's class, module, source file and constructor arguments) and takes no import path. `SHIPPED_USER_CODE` lists the
other kind: the committed genomics jobs' presets name the examples' models by import path, as a user names their own
(``--model module:Class``). The server runtime never imports build time. The test fails on any other crossing and on
a listed one that no longer exists.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tests.test_import_graph import EXAMPLES, REPO, import_graph, installed_modules

#: Bottom first; packages in one tuple share a layer and must not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("aggregators.contracts",),
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
        "jobs.fedopt_final -> controllers.he_fedopt",
        "jobs.secure_aggregation -> controllers.he_fedopt",
        "jobs.secure_aggregation -> controllers.secagg",
        "jobs.secure_aggregation -> controllers.secagg_site",
        "jobs.secure_aggregation -> controllers.secure_aggregation",
    }
)
#: The user code a committed job's preset names by import path (``model="genomics.model:SnpClassifier"``), as a user
#: names their own: build time loads it only through the user-code path (`jobs.user_checks`) and ships it with the job.
SHIPPED_USER_CODE: frozenset[str] = frozenset(
    {
        "jobs.presets -> genomics.data",
        "jobs.presets -> genomics.model",
        "jobs.presets -> genomics_consortium.model",
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
        if top in examples:
            return EXAMPLES
        holders = [name for name in level if module == name or module.startswith(name + ".")]
        return max(holders, key=len, default=top)

    found = []
    for importer, imported in graph.items():
        source = package(importer)
        for target in imported:
            if package(target) != source and level[package(target)] >= level[source]:
                found.append(f"{importer} -> {target}")
    return sorted(found)


def top_packages(layers: Sequence[Sequence[str]] = LAYERS) -> list[str]:
    """The top-level packages of ``layers`` (``aggregators.contracts`` is a layer inside ``aggregators``)."""
    return sorted({package.split(".")[0] for layer in layers for package in layer})


def layered_modules(root: Path = REPO) -> dict[str, Path]:
    return installed_modules(root, packages=top_packages())


def test_every_package_has_a_layer() -> None:
    """A new top-level package must be placed in the order (or named as not part of the bundle)."""
    tops = [path for path in REPO.iterdir() if path.is_dir() and not path.name.startswith(".")]
    folders = {path.name for path in tops if next(path.rglob("*.py"), None) is not None}
    assert folders - set(NOT_LAYERED) == set(top_packages()), "place every package in LAYERS"
    inner = [package for package in layer_of() if "." in package]
    assert all((REPO / package.replace(".", "/") / "__init__.py").is_file() for package in inner), inner


def test_imports_follow_the_layers() -> None:
    graph = import_graph(layered_modules(), by_name=True)
    found = set(crossings(graph, examples=frozenset(example_packages())))
    allowed = JOB_API_CROSSINGS | SHIPPED_USER_CODE
    assert not found - allowed, "imports against the layer order:\n" + "\n".join(sorted(found - allowed))
    gone = "\n".join(sorted(allowed - found))
    assert not gone, "no longer imported, remove from JOB_API_CROSSINGS or SHIPPED_USER_CODE:\n" + gone


def test_importing_the_contracts_loads_none_of_the_math() -> None:
    """Python runs ``aggregators/__init__.py`` before any contract module: it must load none of the rules (the
    client script reads the job settings on a site before, and without, importing torch)."""
    contracts = sorted(name for name in layered_modules() if name.startswith("aggregators.contracts."))
    pure = [name for name in contracts if name != "aggregators.contracts.egress_gate"]  # NVFlare glue
    probe = (
        "import importlib, json, sys\n"
        f"for name in {pure!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('aggregators', 'torch'))))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(loaded.stdout) == sorted(["aggregators", "aggregators.contracts", *pure])


# --- the checker itself, on synthetic packages, so that a silent checker cannot pass the test above ---


def _graph(tmp_path: Path, files: Mapping[str, str], packages: Sequence[str]) -> dict[str, set[str]]:
    for relative, source in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    return import_graph(installed_modules(tmp_path, packages=packages), by_name=True)


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
        # a registry named by string, an import_module argument and a class path cross as an import would
        ({"low/a.py": 'WHERE = "top.b:NAMES"\n', "top/b.py": "NAMES = {}\n"}, ["low.a -> top.b"]),
        ({"low/a.py": 'import importlib\nimportlib.import_module("top.b")\n', "top/b.py": ""}, ["low.a -> top.b"]),
        ({"low/a.py": 'PATH = "top.b.Thing"\n', "top/b.py": "class Thing: ...\n"}, ["low.a -> top.b"]),
        # prose and docstrings that mention a module are not dependencies
        ({"low/a.py": '"""top.b"""\nNOTE = "see top.b"\n', "top/b.py": ""}, []),
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


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # the math on top of its own contracts: downward
        ({"low/__init__.py": "", "low/math.py": "from low.base import wire\n", "low/base/wire.py": ""}, []),
        # a contract importing the math above it, even by a registry's name, crosses
        ({"low/base/wire.py": "import low.math\n", "low/math.py": ""}, ["low.base.wire -> low.math"]),
        ({"low/base/wire.py": 'R = "low.math:RULES"\n', "low/math.py": ""}, ["low.base.wire -> low.math"]),
    ],
)
def test_a_package_inside_another_is_a_layer_of_its_own(
    tmp_path: Path, files: Mapping[str, str], expected: list[str]
) -> None:
    layers = (("low.base",), ("low",), ("top",))
    assert crossings(_graph(tmp_path, files, ["low", "top"]), layers) == expected
