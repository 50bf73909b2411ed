"""Unknown keys are refused in one line naming the key and the allowed ones, with exit code 2 and nothing written:
client algorithm and server rule hyperparameters (checked against their declared fields), and the recipe's keywords
(which go through the builder's ``spec_from_values``, so it raises the builder's error and message)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aggregators.fedopt import TAU_FLOOR_WHY
from aggregators.registry import RULES, build_rule, rule_args_problem, rule_settings
from aggregators.types import AggregationError
from jobs.build import JobBuildError, JobSpec, main
from jobs.recipe import FedAlgRecipe
from jobs.settings import registries, registry_problem, setting_fields
from jobs.spec import spec_from_values

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--client", "scaffold", "--client-args", '{"zzz":1}'],
            "error: --client-args: scaffold has no setting 'zzz'; allowed: option, estimator, correction",
        ),
        (
            ["--server", "krum", "--server-args", '{"f":5}'],
            "error: --server-args: krum has no setting 'f'; allowed: num_byzantine, num_selected",
        ),
        (
            ["--client", "fedavg", "--client-args", '{"mu":0.1,"zzz":1}'],
            "error: --client-args: fedavg has no settings 'mu', 'zzz'; it takes none",
        ),
        (
            ["--client", "fedprox", "--client-args", '{"mu":-1}'],
            "error: --client-args: fedprox: hyperparameter 'mu' must be a finite number >= 0, got -1",
        ),
        (
            ["--client", "scaffold", "--client-args", '{"option":"III"}'],
            "error: --client-args: scaffold: hyperparameter 'option' must be one of ['I', 'II'], got 'III'",
        ),
    ],
)
def test_the_builder_refuses_unknown_or_bad_hyperparameters_in_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "jobs"
    assert main([*argv, "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err.strip() == message
    assert not out.exists()


def test_the_builder_refuses_a_fedopt_tau_below_its_floor_in_one_line_with_the_reason(tmp_path, capsys):
    """The rule's own refusal (aggregators/fedopt.py, TAU_FLOOR) reaches the builder before anything is written."""
    out = tmp_path / "jobs"
    assert main(["--server", "fedadam", "--server-args", '{"tau": 1e-40}', "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    expected = (
        "error: --server-args: fedadam: hyperparameter 'tau' must be a finite number >= 1e-12 (m and v are float32"
    )
    assert err.startswith(expected) and err.endswith("), got 1e-40") and TAU_FLOOR_WHY in err and "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_server_rule_checks_keys_against_its_fields(name):
    allowed = rule_settings(RULES[name])
    problem = rule_args_problem(name, {"zzz": 1})
    assert problem == f"{name} has no setting 'zzz'; " + (
        f"allowed: {', '.join(allowed)}" if allowed else "it takes none"
    )
    with pytest.raises(AggregationError, match=re.escape(f"bad hyperparameters for rule '{name}': {problem}")):
        build_rule(name, zzz=1)


def test_a_rule_that_is_no_dataclass_checks_its_own_arguments(monkeypatch):
    class Plain:
        name = "plain"

        def __init__(self, k: float = 1.0) -> None:
            self.k = k

    monkeypatch.setitem(RULES, "plain", Plain)
    assert rule_args_problem("plain", {"zzz": 1}) is None
    with pytest.raises(AggregationError, match=r"bad hyperparameters for rule 'plain': .*unexpected keyword"):
        build_rule("plain", zzz=1)


def test_a_spec_names_the_unknown_client_key_before_anything_else_builds_the_algorithm():
    """devices > 1 builds the client algorithm early (DDP refusals): an unknown key is still one line there."""
    ship = str(REPO / "examples" / "custom_model")
    own = {"model": "custom_model.model:DigitsClassifier", "data": "custom_model.data:DigitsSites", "ship": ship}
    with pytest.raises(JobBuildError, match=r"^--client-args: fedprox has no setting 'zzz'; allowed: mu$"):
        JobSpec(name="ddp", devices=2, client="fedprox", client_args={"zzz": 1}, **own)


@pytest.mark.parametrize("settings", [{"zzz": 1}, {"zzz": 1, "yyy": 2, "lr": 0.1}])
def test_the_recipe_refuses_unknown_keywords_as_the_builder_does(settings):
    with pytest.raises(JobBuildError) as from_builder:
        spec_from_values("fedalg", settings)
    with pytest.raises(JobBuildError) as from_recipe:
        FedAlgRecipe(**settings)
    assert str(from_recipe.value) == str(from_builder.value)
    assert str(from_recipe.value).startswith("a job has no setting") and "\n" not in str(from_recipe.value)
    assert "allowed: dataset, scheme, alpha" in str(from_recipe.value)


def test_the_recipe_names_min_clients_when_given_num_sites():
    with pytest.raises(JobBuildError, match=r"^num_sites 3: the recipe takes the number of sites as min_clients; "):
        FedAlgRecipe(num_sites=3)


def test_the_recipe_refuses_unknown_hyperparameters_with_the_builders_line():
    with pytest.raises(
        JobBuildError, match=r"^--client-args: scaffold has no setting 'zzz'; allowed: option, estimator, corr"
    ):
        FedAlgRecipe(client="scaffold", server="scaffold", client_args={"zzz": 1})
    with pytest.raises(JobBuildError, match=r"^--server-args: krum has no setting 'f'; allowed: num_byzantine, num_"):
        FedAlgRecipe(server="krum", server_args={"f": 5})


@pytest.mark.parametrize(
    ("lr", "momentum", "advised"),
    [
        (0.05, 0.0, True),  # plain SGD at 0.05: measured collapse (scaffold_label_skew.md)
        (0.01, 0.9, True),  # effective 0.01 / (1 - 0.9) = 0.1: NIID-Bench's collapse (niid_bench.md)
        (0.02, 0.0, False),  # effective 0.02: at the limit, not above it
        (0.002, 0.9, False),  # effective 0.02
    ],
)
def test_scaffold_under_strong_skew_is_advised_by_its_effective_learning_rate(lr, momentum, advised):
    from jobs.spec import JobSpec, advisories

    spec = JobSpec(
        name="skew",
        client="scaffold",
        server="scaffold",
        scheme="label_quantity",
        classes_per_site=2,
        lr=lr,
        momentum=momentum,
    )
    notes = [note for note in advisories(spec) if note.startswith("SCAFFOLD with lr")]
    assert bool(notes) is advised
    if advised:
        assert f"effective lr {lr / (1 - momentum):g}" in notes[0] and "niid_bench.md" in notes[0]


def test_every_registry_a_setting_names_is_one_build_time_resolves():
    """The bottom layer names its registries by name; build time maps each name to the registry itself."""
    named = {spec_field.metadata["registry"] for spec_field, _ in setting_fields() if spec_field.metadata["registry"]}
    resolved = registries()
    assert named == set(resolved) == {"client_algorithms", "models", "rules"}
    assert resolved["rules"] is RULES


def test_a_registry_the_caller_does_not_hand_over_is_an_error_not_a_pass():
    server = next(spec_field for spec_field, _ in setting_fields() if spec_field.name == "server")
    with pytest.raises(LookupError, match="server takes a name from the registry 'rules', not among \\['models'\\]"):
        registry_problem(server, "fedavg", {"models": {}})
    assert registry_problem(server, "nope", {"rules": RULES}).startswith("unknown server 'nope'; choose one of")
