"""The committed jobs carry no copy of the bundle's code: the example packages their models and data come from are
installed with the bundle (pyproject.toml), so no job folder holds a package of its own."""

from __future__ import annotations

import tomllib

from jobs.assembly import JOBS_DIR, installed_with_bundle
from jobs.presets import PRESET_SETTINGS

PYPROJECT = tomllib.loads((JOBS_DIR.parent / "pyproject.toml").read_text())


def test_no_committed_job_carries_a_package_folder():
    copied = sorted(str(p.relative_to(JOBS_DIR)) for p in JOBS_DIR.glob("*/app/custom/*") if p.is_dir())
    assert copied == []


def test_every_preset_imports_its_model_and_data_from_the_installed_bundle():
    # A preset that ships nothing must name modules the bundle installs, or every site would fail to import them.
    outside = {
        name: path
        for name, settings in PRESET_SETTINGS.items()
        for path in (settings.get("model"), settings.get("data"))
        if path and not settings.get("ship") and not installed_with_bundle(path.partition(":")[0], PYPROJECT)
    }
    assert outside == {}


def test_the_bundle_installs_the_examples_and_nothing_else_by_that_rule():
    assert installed_with_bundle("genomics.model", PYPROJECT)
    assert installed_with_bundle("genomics_consortium.model", PYPROJECT)
    assert not installed_with_bundle("custom_model.model", PYPROJECT)  # a user's package is never assumed installed
    assert not installed_with_bundle("genomics_extra.model", PYPROJECT)  # whole names, not prefixes
