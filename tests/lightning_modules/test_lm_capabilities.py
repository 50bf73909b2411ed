"""What an algorithm may do is declared on its class (lightning_modules/algorithms/capabilities.py) and every table
elsewhere is derived from those declarations over the registries; no exclusion asks an algorithm's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from aggregators.contracts import meta_keys
from aggregators.registry import RULES
from lightning_modules.algorithms import CLIENT_ALGORITHMS, ClientAlgorithm
from lightning_modules.algorithms.capabilities import PersonalModel, declared_dp_sgd
from lightning_modules.algorithms.fedprox import FedProx
from lightning_modules.federated import FederatedAlgorithm
from lightning_modules.personalization.methods import (
    FINETUNE,
    PARTIAL_SHARING,
    ActiveMethod,
    active_methods,
    collision,
    personal_methods,
)
from lightning_modules.privacy import dp_sgd, release

ROOT = Path(__file__).resolve().parents[2]
KEYS = {value for name, value in vars(meta_keys).items() if name.isupper() and isinstance(value, str)}


@pytest.mark.parametrize("name", sorted(CLIENT_ALGORITHMS))
def test_every_key_an_algorithm_sends_lives_in_meta_keys_and_has_its_own_release_status(name):
    cls = CLIENT_ALGORITHMS[name]
    assert set(cls.sent_meta) <= KEYS, f"{name}: add {set(cls.sent_meta) - KEYS} to aggregators/contracts/meta_keys.py"
    own = {item.pattern for item in cls.released}
    for key in cls.sent_meta:
        assert release.status_of(key).pattern in own, f"{name}: declare {key!r} in its class's released"


def test_the_privacy_tables_are_the_declarations():
    for name, cls in CLIENT_ALGORITHMS.items():
        declared = declared_dp_sgd(cls)
        assert (dp_sgd.COMPOSES if declared.composes else dp_sgd.REFUSED)[name] == declared.why
    assert set(dp_sgd.COMPOSES) | set(dp_sgd.REFUSED) == set(CLIENT_ALGORITHMS)
    declared_items = [item for cls in CLIENT_ALGORITHMS.values() for item in cls.released]
    assert all(item in release.RELEASED for item in declared_items)
    # each algorithm's items come before the withheld catch-alls, so that their status is the one status_of finds
    assert max(release.RELEASED.index(item) for item in declared_items) < release.RELEASED.index(release.WITHHELD[0])


def test_a_subclass_that_declares_nothing_is_refused_under_dp():
    """A user's FedProx that adds a pass on the data inherits FedProx's hooks, not its accounting."""

    class MoreThanFedProx(FedProx):
        name = "more"

    assert dp_sgd.algorithm_problem(FedProx()) is None
    assert "cannot run under DP-SGD: its extra computations" in dp_sgd.algorithm_problem(MoreThanFedProx())


def test_scaffold_option_i_is_refused_by_its_own_setting():
    scaffold = CLIENT_ALGORITHMS["scaffold"]
    assert dp_sgd.algorithm_problem(scaffold()) is None
    assert "with option I sends a control" in dp_sgd.algorithm_problem(scaffold(option="I"))


def test_the_personalization_axis_holds_every_declared_personal_model():
    methods = personal_methods(CLIENT_ALGORITHMS)
    assert methods["finetune"] is FINETUNE and methods["partial_sharing"] is PARTIAL_SHARING
    declared = {name for name, cls in CLIENT_ALGORITHMS.items() if cls.personal_model is not None}
    assert {"ditto", "fedrep", "apfl"} <= declared and declared <= set(methods)


@pytest.mark.parametrize("name", [n for n, c in CLIENT_ALGORITHMS.items() if c.personal_model is not None])
def test_finetuning_beside_any_personal_algorithm_collides_and_partial_sharing_does_not(name):
    cls = CLIENT_ALGORITHMS[name]
    problem = collision(active_methods(cls, finetune_epochs=1, has_local_keys=False))
    assert problem is not None and cls.personal_model.what in problem and "\n" not in problem
    assert collision(active_methods(cls, finetune_epochs=0, has_local_keys=True)) is None


def test_a_new_kind_of_personal_model_collides_by_its_kind_not_its_name():
    copy_like = ActiveMethod("client 'mine'", PersonalModel("copy", "my own copy"))
    assert "my own copy" in collision([ActiveMethod("local_keys (FedPer/FedBN)", PARTIAL_SHARING), copy_like])
    with pytest.raises(ValueError, match="personal model kind"):
        PersonalModel("shadow", "undeclared kind")


def test_personal_weights_without_the_declaration_are_never_scored():
    class Undeclared(ClientAlgorithm):
        name = "undeclared"

        def personal_weights(self, module):
            return {"weight": torch.zeros(1)}

    callback = FederatedAlgorithm(Undeclared(), site="site-1")
    assert callback._personal_weights(torch.nn.Linear(1, 1)) is None


def test_the_nvflare_aggregator_table_is_the_rules_declarations():
    from controllers.nvflare_aggregator import RuleAggregator

    declared = {n: c.translation_equivariant for n, c in RULES.items() if c.translation_equivariant is not None}
    assert declared == RuleAggregator.EQUIVARIANT and "fedavg" in declared


#: Name comparisons that are no exclusion: a measured note about one algorithm (the builder's advisories), the
#: reference run against NVFlare's own handlers, and Ditto's choice of its own global part.
NAMED_ON_PURPOSE = {("jobs/spec.py", "advisories"), ("jobs/nvflare_reference.py", "check_comparable")}
LIBRARY = ("aggregators", "controllers", "jobs", "lightning_modules")


def name_comparisons(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every comparison (``==``, ``!=``, ``in``) with a registered client algorithm's
    or server rule's name (``spec.server == "dp_fedavg"``), but Ditto's choice of its own global part."""
    found = []
    names = set(CLIENT_ALGORITHMS) | set(RULES)
    tree = ast.parse(path.read_text())
    for function in [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]:
        for node in ast.walk(function):
            if not isinstance(node, ast.Compare):
                continue
            if isinstance(node.left, ast.Attribute) and node.left.attr == "global_client":
                continue
            constants = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
            if constants:
                found.append((function.name, node.lineno))
    return found


def test_no_library_code_asks_a_client_algorithms_name_where_a_capability_answers():
    offenders = []
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            for function, line in name_comparisons(path):
                if (relative, function) not in NAMED_ON_PURPOSE:
                    offenders.append(f"{relative}:{line} ({function})")
    assert offenders == [], "declare a capability on the algorithm and ask it instead"


def test_partial_sharing_is_refused_with_the_rules_own_declaration():
    from jobs.spec import JobBuildError, JobSpec

    refusing = {name: cls.partial_sharing_refused for name, cls in RULES.items() if cls.partial_sharing_refused}
    assert set(refusing) == {"attack_adaptive"}
    with pytest.raises(JobBuildError) as info:
        JobSpec(
            name="bad",
            dataset="digits",
            arch="mlp",
            server="attack_adaptive",
            server_args={"attention_model_path": "checkpoints/attention_lenet5.pt"},
            local_keys="net.classifier.*",
        )
    assert str(info.value) == f"local_keys with server 'attack_adaptive': {refusing['attack_adaptive']}"
