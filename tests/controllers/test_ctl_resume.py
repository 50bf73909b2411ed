"""Resume (docs/design.md decision 5): k rounds, stop, resume for the rest == one uninterrupted run, bit for bit.

The controller's ``run()`` is driven with NVFlare's engine calls replaced by deterministic fakes: clients whose
update depends only on the global model they receive, the round and the site; a persistor that writes
``FL_global_model.pt`` the way NVFlare's ``PTFileModelPersistor`` does (``{"model": state_dict}``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from aggregators import dp_fedavg
from aggregators.contracts import meta_keys
from aggregators.registry import RULES
from controllers.checkpoint import GLOBAL_MODEL_FILE, load_resume_point, pending_state_path, save_rule_state
from controllers.fedalg_controller import STATE_FILE, FedAlgController, resumed_population

SITES = ("site-1", "site-2", "site-3")
ROUNDS = 5
STOP_AFTER = 2
X0 = {
    "conv.weight": np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4),
    "bn.running_mean": np.zeros(2, np.float32),
    "bn.num_batches_tracked": np.array(0, np.int64),
}


def client_result(site: str, round_num: int, params: dict, meta_in: dict) -> FLModel:
    """A deterministic 'local training': a pull towards a site-specific target plus seeded noise."""
    index = SITES.index(site)
    rng = np.random.default_rng([index, round_num])
    target = np.full((2, 3, 4), index - 1.0)
    new = {
        "conv.weight": (params["conv.weight"] + 0.3 * (target - params["conv.weight"])).astype(np.float32)
        + rng.normal(0, 0.01, (2, 3, 4)).astype(np.float32),
        "bn.running_mean": params["bn.running_mean"] + np.float32(index),
        "bn.num_batches_tracked": params["bn.num_batches_tracked"] + 10,
    }
    meta = {
        "client_name": site,
        meta_keys.NUM_SAMPLES: 10 + index,
        meta_keys.PARAM_KEYS: ["conv.weight"],
        meta_keys.FEDNOVA_TAU: 3 + index,
        meta_keys.FEDNOVA_A_NORM: 3.0 + index,
        meta_keys.SCAFFOLD_CTRL_DIFF: {"conv.weight": rng.normal(0, 0.1, (2, 3, 4)).astype(np.float32)},
        meta_keys.FEDDYN_ALPHA_K: 0.01,
        meta_keys.FEDDYN_PARAM_KEYS: ["conv.weight"],
    }
    return FLModel(params=new, meta=meta)


class FakeEngineController(FedAlgController):
    """The real controller with NVFlare's engine, persistor and task exchange replaced by in-process fakes."""

    def __init__(
        self,
        app_dir: Path,
        stop_after: int | None = None,
        failing_rounds: tuple[int, ...] = (),
        connected: tuple[str, ...] = SITES,
        silent: tuple[str, ...] = (),
        **kwargs,
    ):
        kwargs.setdefault("clients_per_round", 2)
        super().__init__(evaluator_id="", settings=kwargs)  # the round settings by their job names
        self.app_dir, self.stop_after, self.failing_rounds = app_dir, stop_after, failing_rounds
        self.silent = silent  # sites of the job that never answer (a site that went down)
        self.app_dir.mkdir(parents=True, exist_ok=True)
        self.engine = SimpleNamespace(get_clients=lambda: [SimpleNamespace(name=s) for s in connected])
        self.abort_signal = SimpleNamespace(triggered=False)
        self.sent_meta: list[dict] = []
        self.sent_targets: list[list[str]] = []
        self.warnings: list[str] = []
        self.rounds_run = 0

    def load_model(self):
        return FLModel(params={k: v.copy() for k, v in X0.items()})

    def save_model(self, model):
        tensors = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in model.params.items()}
        torch.save({"model": tensors, "train_conf": {}}, self.app_dir / GLOBAL_MODEL_FILE)

    def send_model_and_wait(self, targets, data, min_responses=None, timeout=0):
        self.sent_meta.append(dict(data.meta))
        self.sent_targets.append(list(targets))
        answering = [site for site in targets if site not in self.silent]
        results = [client_result(site, data.current_round, data.params, data.meta) for site in answering]
        if data.current_round in self.failing_rounds:  # every site sends NaN: all rejected, the round fails
            for result in results:
                result.params["conv.weight"] = np.full_like(result.params["conv.weight"], np.nan)
        self.rounds_run += 1
        if self.stop_after is not None and self.rounds_run >= self.stop_after:
            self.abort_signal.triggered = True  # the job is stopped here (checked before the next round)
        return results

    def get_app_dir(self):
        return str(self.app_dir)

    def get_run_dir(self):
        return str(self.app_dir.parent)

    def info(self, msg, *args, **kwargs):
        pass

    error = info

    def warning(self, msg, *args, **kwargs):
        self.warnings.append(msg)


def _final(app_dir: Path) -> tuple[dict, dict]:
    payload = torch.load(app_dir / STATE_FILE, weights_only=True)
    model = torch.load(app_dir / GLOBAL_MODEL_FILE, weights_only=True)["model"]
    return {k: v.numpy() for k, v in model.items()}, payload


def _statuses(run_dir: Path) -> list[str]:
    lines = (run_dir / "metrics" / "round_metrics.jsonl").read_text().splitlines()
    return [record["status"] for record in map(json.loads, lines) if "status" in record]


def _assert_identical(a, b, where="state"):
    if isinstance(a, torch.Tensor | np.ndarray):
        assert np.asarray(a).dtype == np.asarray(b).dtype, where
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, where


#: What a registered rule needs to run on this three-site federation (default: two sites a round, no arguments).
NEEDS = {
    "attack_adaptive": {"server_args": {"allow_random_attention": True}},  # the shipped network fits LeNet-5 only
    "krum": {"clients_per_round": None, "server_args": {"num_byzantine": 0}},  # n - f - 2 >= 1 with three sites
}
#: Settings other than the defaults whose state must survive a resume as well.
VARIANTS = {
    "fedyogi+scaffold": {
        "server": "fedyogi",
        "server_args": {"server_lr": 0.05},
        "companions": {"scaffold_control": {}},
    },
    "fedadam-bias": {"server": "fedadam", "server_args": {"bias_correction": True}},
    "fednova-momentum": {"server": "fednova", "server_args": {"server_momentum": 0.5}},
    "fedatt-noise": {"server": "fedatt", "server_args": {"noise": 0.01, "seed": 3}},
}
#: Every registered rule (from the registry: a new rule is under this test once registered), then the variants.
RULES_UNDER_TEST = {name: {"server": name, **NEEDS.get(name, {})} for name in sorted(RULES)} | VARIANTS


def test_the_adaptations_name_registered_rules():
    assert set(NEEDS) <= set(RULES) and {case["server"] for case in VARIANTS.values()} <= set(RULES)


def stop_and_resume(
    tmp_path: Path, settings: dict, restart=lambda: None
) -> tuple[FakeEngineController, FakeEngineController, FakeEngineController]:
    """An uninterrupted run (``straight/``), one stopped after STOP_AFTER rounds (``first/``) and its resumption
    (``resumed/``, after ``restart()``, e.g. the restarted server's own draws)."""
    straight = FakeEngineController(tmp_path / "straight" / "app", num_rounds=ROUNDS, **settings)
    straight.run()
    first = FakeEngineController(tmp_path / "first" / "app", stop_after=STOP_AFTER, num_rounds=ROUNDS, **settings)
    first.run()
    assert first.rounds_run == STOP_AFTER
    restart()
    resumed = FakeEngineController(
        tmp_path / "resumed" / "app", num_rounds=ROUNDS, resume_from=str(tmp_path / "first" / "app"), **settings
    )
    resumed.run()
    assert resumed.rounds_run == ROUNDS - STOP_AFTER
    return straight, first, resumed


@pytest.mark.parametrize("case", list(RULES_UNDER_TEST))
def test_stop_and_resume_equals_an_uninterrupted_run(tmp_path, case, monkeypatch):
    settings = RULES_UNDER_TEST[case]
    # DP-FedAvg's noise and site sample come from a secret seed per run (a fixed one is refused with noise), kept in
    # the server's memory only: a resumed job draws a fresh one (test_a_resumed_dp_fedavg_job_draws_a_fresh_seed).
    # Every run gets the same one here, so the resumed run must equal the uninterrupted one.
    monkeypatch.setattr(dp_fedavg, "secret_seed", lambda: 0)
    straight, first, resumed = stop_and_resume(tmp_path, settings)
    # Every round aggregated: a rule these fake clients cannot serve would otherwise pass on an unchanged model.
    assert _statuses(tmp_path / "straight") == ["aggregated"] * ROUNDS
    params_a, state_a = _final(tmp_path / "straight" / "app")
    params_b, state_b = _final(tmp_path / "resumed" / "app")
    _assert_identical(params_a, params_b, "params")
    assert state_a["round"] == state_b["round"] == ROUNDS - 1
    _assert_identical(state_a["state"], state_b["state"])  # moments, controls, angles, step counters
    # Identical broadcasts in the resumed rounds (round index, the SCAFFOLD control) and the same run id.
    for sent_a, sent_b in zip(straight.sent_meta[STOP_AFTER:], resumed.sent_meta, strict=True):
        assert sent_a[meta_keys.ROUND] == sent_b[meta_keys.ROUND]
        if meta_keys.SCAFFOLD_CTRL_GLOBAL in sent_a:
            _assert_identical(sent_a[meta_keys.SCAFFOLD_CTRL_GLOBAL], sent_b[meta_keys.SCAFFOLD_CTRL_GLOBAL])
        # The sites' confirmations survive the stop: each site commits or rolls back its client state as it would.
        assert sent_a[meta_keys.LAST_AGGREGATED] == sent_b[meta_keys.LAST_AGGREGATED]
    assert resumed.sent_meta[0][meta_keys.RUN_ID] == first.sent_meta[0][meta_keys.RUN_ID]
    assert resumed.sent_meta[0][meta_keys.LAST_AGGREGATED]  # two sites per round: some site has a confirmed round


def test_a_resumed_dp_fedavg_job_draws_a_fresh_seed(tmp_path, monkeypatch):
    """The checkpoint holds no seed, so a restarted server cannot continue the stopped run's noise: the resumed
    rounds run on a fresh secret seed (fresh noise and site sample), as docs/privacy.md says; the model and the
    rest of the rule state still continue from the checkpoint."""
    settings = {"server": "dp_fedavg", "server_args": {"noise_multiplier": 1.0, "clip_norm": 0.5, "adaptive": False}}
    monkeypatch.setattr(dp_fedavg, "secret_seed", lambda: 0)
    stop_and_resume(tmp_path, settings, lambda: monkeypatch.setattr(dp_fedavg, "secret_seed", lambda: 1))
    params_a, state_a = _final(tmp_path / "straight" / "app")
    params_b, state_b = _final(tmp_path / "resumed" / "app")
    assert not np.array_equal(params_a["conv.weight"], params_b["conv.weight"])  # other noise after the resume
    assert state_a["state"]["rounds"] == state_b["state"]["rounds"] == ROUNDS  # the accountant continued
    _assert_identical(state_a["state"]["rdp"], state_b["state"]["rdp"])


def test_resume_refuses_a_model_that_does_not_belong_to_the_state(tmp_path):
    app = tmp_path / "app"
    FakeEngineController(app, stop_after=STOP_AFTER, num_rounds=ROUNDS, server="fedadam").run()
    payload = torch.load(app / STATE_FILE, weights_only=True)
    save_rule_state(app / STATE_FILE, "fedadam", payload["round"], {}, global_sha256="0" * 64)
    with pytest.raises(ValueError, match="is not the model"):
        load_resume_point(app, "fedadam")


class _Killed(BaseException):
    """The server's process dying mid-persist (a BaseException: nothing on the way may catch it)."""


class KilledWhileSaving(FakeEngineController):
    """Dies in round ``kill_round`` just before its persistor writes the model (``before_model``), or just after."""

    def __init__(self, app_dir: Path, kill_round: int, before_model: bool, **kwargs):
        super().__init__(app_dir, **kwargs)
        self.kill_round, self.before_model = kill_round, before_model

    def save_model(self, model):
        if model.meta["round"] == self.kill_round and self.before_model:
            raise _Killed
        super().save_model(model)
        if model.meta["round"] == self.kill_round:
            raise _Killed


@pytest.mark.parametrize("before_model", [True, False])
def test_a_server_killed_between_its_two_writes_leaves_a_resumable_pair(tmp_path, before_model):
    """The model and the rule state are two files; a kill between the two writes once left a model the state did
    not name, and the job could not resume. Killed before the model is written, the job resumes at the killed
    round; killed after it, at the next one; either way it ends where the uninterrupted run ends, bit for bit."""
    straight = FakeEngineController(tmp_path / "straight" / "app", num_rounds=ROUNDS, server="fedadam")
    straight.run()
    killed = KilledWhileSaving(tmp_path / "killed" / "app", 2, before_model, num_rounds=ROUNDS, server="fedadam")
    with pytest.raises(_Killed):
        killed.run()
    point = load_resume_point(tmp_path / "killed" / "app", "fedadam")
    assert point.next_round == (2 if before_model else 3)
    resumed = FakeEngineController(
        tmp_path / "resumed" / "app", num_rounds=ROUNDS, server="fedadam", resume_from=str(tmp_path / "killed" / "app")
    )
    resumed.run()
    params_a, state_a = _final(tmp_path / "straight" / "app")
    params_b, state_b = _final(tmp_path / "resumed" / "app")
    _assert_identical(params_a, params_b, "params")
    _assert_identical(state_a["state"], state_b["state"])


def test_resume_ignores_a_pending_state_saved_with_another_model(tmp_path):
    app = tmp_path / "app"
    FakeEngineController(app, stop_after=STOP_AFTER, num_rounds=ROUNDS, server="fedadam").run()
    payload = torch.load(app / STATE_FILE, weights_only=True)
    save_rule_state(pending_state_path(app / STATE_FILE), "fedadam", payload["round"] + 1, {}, global_sha256="1" * 64)
    assert load_resume_point(app, "fedadam").next_round == STOP_AFTER  # the committed pair
    save_rule_state(app / STATE_FILE, "fedadam", payload["round"], {}, global_sha256="0" * 64)
    with pytest.raises(ValueError, match="is not the model"):  # neither state names the model
        load_resume_point(app, "fedadam")


def test_resume_refuses_another_rules_state_and_missing_files(tmp_path):
    app = tmp_path / "app"
    FakeEngineController(app, stop_after=1, num_rounds=ROUNDS, server="fedadam").run()
    with pytest.raises(ValueError, match="written by rule 'fedadam'"):
        load_resume_point(app, "fedyogi")
    with pytest.raises(FileNotFoundError, match="cannot resume"):
        load_resume_point(tmp_path / "nowhere", "fedadam")
    point = load_resume_point(app, "fedadam")
    assert point.next_round == 1 and point.state["step"] == 1 and point.run_id


def test_resume_after_a_round_without_valid_results_continues_after_it(tmp_path):
    """The failed round is a completed round: the checkpoint records it as the last attempted (and the round before
    as the last aggregated), and the resumed job goes on with the next round, as the uninterrupted job did."""
    settings = {"server": "fedyogi", "companions": {"scaffold_control": {}}, "failing_rounds": (1,)}
    straight = FakeEngineController(tmp_path / "straight" / "app", num_rounds=ROUNDS, **settings)
    straight.run()
    first = FakeEngineController(tmp_path / "first" / "app", stop_after=STOP_AFTER, num_rounds=ROUNDS, **settings)
    first.run()
    payload = torch.load(tmp_path / "first" / "app" / STATE_FILE, weights_only=True)
    assert payload["round"] == STOP_AFTER - 1 == 1 and payload["last_aggregated_round"] == 0
    point = load_resume_point(tmp_path / "first" / "app", "fedyogi+scaffold_control")
    assert point.next_round == STOP_AFTER and point.last_aggregated_round == 0
    lines = (tmp_path / "first" / "metrics" / "round_metrics.jsonl").read_text().splitlines()
    failed = json.loads(lines[-1])
    assert failed["round"] == 1 and failed["status"] == "failed" and failed["rule"] == "fedyogi+scaffold_control"
    assert set(failed["rejected"]) == set(failed["sites"]) and "only 0 valid result(s), 1 needed" in failed["failure"]

    resumed = FakeEngineController(
        tmp_path / "resumed" / "app", num_rounds=ROUNDS, resume_from=str(tmp_path / "first" / "app"), **settings
    )
    resumed.run()
    assert resumed.rounds_run == ROUNDS - STOP_AFTER  # the failed round is not re-run
    params_a, state_a = _final(tmp_path / "straight" / "app")
    params_b, state_b = _final(tmp_path / "resumed" / "app")
    _assert_identical(params_a, params_b, "params")
    _assert_identical(state_a["state"], state_b["state"])
    assert state_a["last_aggregated_round"] == state_b["last_aggregated_round"] == ROUNDS - 1


@pytest.mark.parametrize("rule", ["scaffold", "feddyn"])
def test_a_site_down_when_the_job_resumes_stays_in_the_population(tmp_path, rule):
    """NVFlare deploys the resumed job only to the sites connected then. A site that is down keeps counting: the
    resumed job equals, bit for bit, an uninterrupted one in which that site stopped answering at the same point
    (SCAFFOLD's c and FedDyn's h / m stay scaled by all three sites), and the down site is never sent a task."""
    settings = {"server": rule, "clients_per_round": None, "min_responses": 2}
    straight = FakeEngineController(tmp_path / "straight" / "app", num_rounds=ROUNDS, **settings)
    straight.stop_after = STOP_AFTER
    straight.run()
    straight.abort_signal.triggered, straight.stop_after = False, None  # the same job goes on with site-3 silent
    straight.silent = ("site-3",)
    straight.round_settings = dataclasses.replace(straight.round_settings, resume_from=str(straight.app_dir))
    straight.run()
    first = FakeEngineController(tmp_path / "first" / "app", stop_after=STOP_AFTER, num_rounds=ROUNDS, **settings)
    first.run()
    assert _statuses(tmp_path / "first") == ["aggregated"] * STOP_AFTER  # the rule's state did move
    resumed = FakeEngineController(
        tmp_path / "resumed" / "app",
        num_rounds=ROUNDS,
        resume_from=str(tmp_path / "first" / "app"),
        connected=("site-1", "site-2"),
        **settings,
    )
    resumed.run()

    assert all(targets == ["site-1", "site-2"] for targets in resumed.sent_targets)
    assert any("site-3" in w and "population" in w for w in resumed.warnings), resumed.warnings
    params_a, state_a = _final(tmp_path / "straight" / "app")
    params_b, state_b = _final(tmp_path / "resumed" / "app")
    _assert_identical(params_a, params_b, "params")
    _assert_identical(state_a["state"], state_b["state"])
    assert state_b["population"] == list(SITES)


def test_a_resumed_population_is_the_stopped_jobs_plus_the_connected_sites():
    assert resumed_population(["site-2", "site-1"], ("site-1", "site-2", "site-3")) == SITES
    assert resumed_population(["site-4"], ["site-1"]) == ("site-1", "site-4")
    assert resumed_population(["site-2", "site-1"], None) == ("site-1", "site-2")  # a checkpoint without it


class DPSitesController(FakeEngineController):
    """Sites that report a cumulative DP-SGD step count (5 a round) with every result, as DP sites do."""

    def send_model_and_wait(self, targets, data, min_responses=None, timeout=0):
        results = super().send_model_and_wait(targets, data, min_responses, timeout)
        for result in results:
            result.meta[meta_keys.PRIVACY_STEPS] = 5 * (data.current_round + 1)
        return results


def test_a_resumed_job_still_broadcasts_what_each_dp_site_released(tmp_path):
    """The server's record of each DP site's released steps (``server.released_steps``, against which a site checks
    its ledger for staleness) is checkpointed and restored: the resumed job's first broadcast carries it."""
    first = DPSitesController(tmp_path / "first" / "app", stop_after=STOP_AFTER, num_rounds=ROUNDS, server="fedavg")
    first.run()
    expected = {site: 5 * (r + 1) for r, targets in enumerate(first.sent_targets) for site in targets}
    assert first.sent_meta[1][meta_keys.RELEASED_STEPS] == {s: 5 for s in first.sent_targets[0]}  # round 2's
    assert load_resume_point(tmp_path / "first" / "app", "fedavg").released_steps == expected
    resumed = DPSitesController(
        tmp_path / "resumed" / "app", num_rounds=ROUNDS, server="fedavg", resume_from=str(tmp_path / "first" / "app")
    )
    resumed.run()
    assert resumed.sent_meta[0][meta_keys.RELEASED_STEPS] == expected
