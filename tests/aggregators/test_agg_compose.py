"""Composition: companion state rules beside any model-update rule, and the build-time check that says why not."""

from __future__ import annotations

import json

import numpy as np
import pytest

from aggregators.compose import COMPANIONS, ComposedRule, CompositionError, compose, plan_composition
from aggregators.contracts import meta_keys
from aggregators.registry import RULES, build_rule
from aggregators.scaffold import Scaffold
from aggregators.types import ClientUpdate, RoundContext
from jobs.build import JobBuildError, JobSpec, export_job, main
from lightning_modules.algorithms import CLIENT_ALGORITHMS

DIFF, GLOBAL = meta_keys.SCAFFOLD_CTRL_DIFF, meta_keys.SCAFFOLD_CTRL_GLOBAL
CONTEXT = RoundContext(round_num=0, num_rounds=2, population=("site-1", "site-2", "site-3", "site-4"))
X0 = {"w": np.array([0.0, 1.0], np.float32), "count": np.array(3, np.int64)}


def _update(site, w, dc, n=1):
    params = {"w": np.array(w, np.float32), "count": np.array(5, np.int64)}
    return ClientUpdate(site, params, n, {DIFF: {"w": np.array(dc, np.float32)}})


def test_scaffold_beside_fedyogi_steps_the_model_like_fedyogi_and_the_control_like_scaffold():
    rule = compose(build_rule("fedyogi", server_lr=0.1), {"scaffold_control": {}})
    assert isinstance(rule, ComposedRule) and rule.name == "fedyogi+scaffold_control"
    assert GLOBAL in rule.broadcast_keys and DIFF in rule.required_meta
    updates = [_update("site-1", [0.2, 1.0], [1.0, 2.0], 1), _update("site-3", [0.0, 0.6], [3.0, -2.0], 3)]
    state = rule.init_state(X0)
    assert rule.broadcast_meta(state) == {GLOBAL: {}}
    result = rule.aggregate(X0, updates, state, CONTEXT)
    alone = build_rule("fedyogi", server_lr=0.1)
    expected = alone.aggregate(X0, updates, alone.init_state(X0), CONTEXT)
    np.testing.assert_array_equal(result.params["w"], expected.params["w"])
    for key in ("m", "v"):
        np.testing.assert_array_equal(result.state["rule"][key]["w"], expected.state[key]["w"])
    scaffold = Scaffold().aggregate(X0, updates, Scaffold().init_state(X0), CONTEXT)  # c += (1/N) sum dc, N = 4
    control = result.state["companions"]["scaffold_control"]["control"]
    np.testing.assert_array_equal(control["w"], scaffold.state["control"]["w"])
    np.testing.assert_allclose(control["w"], [1.0, 0.0])
    np.testing.assert_array_equal(rule.broadcast_meta(result.state)[GLOBAL]["w"], control["w"])


def test_companion_checks_reject_a_bad_control_diff_by_key():
    rule = compose(build_rule("fednova"), {"scaffold_control": {}})
    bad = ClientUpdate("site-1", dict(X0), 1, {DIFF: {"w": np.zeros(3, np.float32)}})
    problems = rule.update_problems(bad, X0, rule.init_state(X0))
    assert any("shape" in p for p in problems)  # the companion's check
    assert any(meta_keys.FEDNOVA_TAU in p for p in problems)  # and the model rule's own


def test_no_companion_means_the_plain_rule():
    rule = build_rule("fedadp")
    assert compose(rule, None) is rule and compose(rule, {}) is rule


@pytest.mark.parametrize(
    ("client", "server", "companions"),
    [
        ("scaffold", "fedyogi", ("scaffold_control",)),
        ("scaffold", "fedadp", ("scaffold_control",)),
        ("scaffold", "scaffold", ()),
        ("fedprox", "fednova", ()),
        ("fedavg", "fedadam", ()),
        ("feddyn", "feddyn", ()),
    ],
)
def test_meaningful_pairs_plan_their_companions(client, server, companions):
    assert plan_composition(CLIENT_ALGORITHMS[client], RULES[server]) == companions


@pytest.mark.parametrize(
    ("client", "server", "why"),
    [
        ("scaffold", "fednova", r"no such \|\|a_i\|\|_1 exists"),
        ("feddyn", "fednova", r"no such \|\|a_i\|\|_1 exists"),
        ("feddyn", "fedyogi", "itself the model update"),
        ("fedavg", "scaffold", r"needs \['scaffold.ctrl.diff'\] from every client"),
        ("fedprox", "feddyn", "server rule 'feddyn' needs"),
    ],
)
def test_meaningless_pairs_are_refused_with_the_reason(client, server, why):
    with pytest.raises(CompositionError, match=why):
        plan_composition(CLIENT_ALGORITHMS[client], RULES[server])
    with pytest.raises(JobBuildError, match=why):
        JobSpec(name="bad", client=client, server=server)


def test_every_pair_either_plans_or_says_why():
    for client_cls in CLIENT_ALGORITHMS.values():
        for rule_cls in RULES.values():
            try:
                companions = plan_composition(client_cls, rule_cls)
            except CompositionError as exc:
                assert client_cls.name in str(exc) or rule_cls.name in str(exc)
                continue
            needs = set(client_cls.required_server_meta)
            provided = set(rule_cls.broadcast_keys) | {k for c in companions for k in COMPANIONS[c].broadcast_keys}
            assert needs <= provided, (client_cls.name, rule_cls.name)


def test_cli_exports_scaffold_with_fedyogi_and_wires_the_companion(tmp_path, capsys):
    assert main(["--client", "scaffold", "--server", "fedyogi", "--output-dir", str(tmp_path)]) == 0
    assert "exported" in capsys.readouterr().out
    server = json.loads((tmp_path / "scaffold_fedyogi" / "app" / "config" / "config_fed_server.json").read_text())
    controller = next(w for w in server["workflows"] if w["path"].endswith("FedAlgController"))
    assert controller["args"]["settings"]["server"] == "fedyogi"
    assert controller["args"]["settings"]["companions"] == {"scaffold_control": {}}


def test_cli_refuses_a_meaningless_pair_in_one_line(capsys):
    assert main(["--client", "scaffold", "--server", "fednova", "--output-dir", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "||a_i||_1" in err and "\n" not in err


def test_plain_jobs_carry_no_companions(tmp_path):
    job = export_job(JobSpec(name="plain", server="fedadam"), tmp_path)
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    controller = next(w for w in server["workflows"] if w["path"].endswith("FedAlgController"))
    settings = controller["args"]["settings"]
    assert "companions" not in settings and "resume_from" not in settings
