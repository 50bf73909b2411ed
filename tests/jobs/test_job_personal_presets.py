"""Every committed personal job can tell each site whether joining helped it: a validation split to select on, a
site's own test split to report on, the local-only model and keep best (docs/personalization.md). Without them a
site's report has nothing but the global model's scores to show."""

from __future__ import annotations

from jobs.presets import PRESETS
from jobs.spec import has_test_split, has_validation_split, personal_method


def missing_site_gain_settings(spec) -> list[str]:
    """What ``spec`` lacks to report global, personal and local-only models per site on the site's own test split."""
    missing = [] if has_validation_split(spec) else ["a validation split"]
    missing += [] if has_test_split(spec) else ["a test split"]
    missing += [] if spec.keep == "best" else ["keep best"]
    missing += [] if spec.local_baseline else ["local_baseline"]
    # The genomics example's test_dataloader without test_fraction is a pooled benchmark set no real site has.
    if spec.model is not None and not spec.data_args.get("test_fraction", 0) > 0:
        missing.append("the data module's own test split (test_fraction)")
    return missing


def test_every_personal_preset_scores_global_personal_and_local_only_on_a_site_test_split():
    # Built here, not at collection: building a preset validates it (imports the models), seconds on a cold start.
    personal = {name: spec for name, spec in PRESETS.items() if personal_method(spec) is not None}
    assert {"finetune", "ditto", "snp_ditto", "fedbn", "fedrep"} <= set(personal)  # the ones the docs name
    lacking = {name: missing_site_gain_settings(spec) for name, spec in personal.items()}
    assert {name: missing for name, missing in lacking.items() if missing} == {}
