"""FedOpt under secure aggregation, taken at the sites (controllers/he_fedopt.py), in process with fake sites.

Over three rounds, three sites that step on the weighted mean hold the x a server running the bundle's plaintext
FedOpt rule would hold (to 1e-6), every site the same bits; under CKKS (TenSEAL, NVFlare's decryptor, the bundle's
filters) every site decrypts the same bits and the sites agree; a restarted site continues identically; a site whose
state diverged is named in one line and the server stops the job; the job is wired and refused as documented.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.fedopt import FEDOPT_RULES
from aggregators.registry import build_rule
from aggregators.types import ClientUpdate, RoundContext
from controllers import he_fedopt
from controllers.he_fedopt import SiteOptimizer, SiteOptimizerError, divergence_problem
from lightning_modules.state_store import ClientStateStore

SITES = ("site-1", "site-2", "site-3")
SAMPLES = {"site-1": 120, "site-2": 300, "site-3": 580}
TRAINABLE = ["conv.weight", "conv.bias", "fc.weight"]
ROUNDS = 3


def initial_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "conv.weight": rng.normal(0, 0.3, (4, 3, 3)).astype(np.float32),
        "conv.bias": np.zeros(4, np.float32),
        "bn.running_mean": np.zeros(4, np.float32),
        "bn.num_batches_tracked": np.array(0, np.int64),
        "fc.weight": rng.normal(0, 0.1, (5, 4)).astype(np.float32),
    }


def train(site: str, round_num: int, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A site's "training": a seeded move of every trainable entry, new buffer statistics, counted batches."""
    rng = np.random.default_rng([SITES.index(site), round_num])
    y = {key: (x[key] + rng.normal(0, 0.02, x[key].shape)).astype(np.float32) for key in TRAINABLE}
    y["bn.running_mean"] = rng.normal(0, 1, 4).astype(np.float32)
    y["bn.num_batches_tracked"] = x["bn.num_batches_tracked"] + 10
    return y


def weighted_mean(models: dict[str, dict[str, np.ndarray]]) -> dict[str, list[float]]:
    """sum_i p_i y_i in float64, flat lists of floats, as NVFlare's decryptor hands a decrypted model on."""
    total = sum(SAMPLES.values())
    return {
        key: sum(SAMPLES[s] / total * models[s][key].astype(np.float64) for s in SITES).ravel().tolist()
        for key in models[SITES[0]]
    }


class Server:
    """The bundle's plaintext FedOpt rule at a server that sees every site's model."""

    def __init__(self, rule: str, args: dict, x: dict[str, np.ndarray]) -> None:
        self.rule, self.x = build_rule(rule, **args), x
        self.state = self.rule.init_state(x)

    def aggregate(self, round_num: int, models: dict[str, dict[str, np.ndarray]]) -> None:
        updates = [ClientUpdate(s, models[s], SAMPLES[s], {meta_keys.PARAM_KEYS: TRAINABLE}) for s in SITES]
        result = self.rule.aggregate(self.x, updates, self.state, RoundContext(round_num, ROUNDS, SITES))
        self.x, self.state = dict(result.params), result.state


def optimizers(tmp_path, rule: str, args: dict) -> dict[str, SiteOptimizer]:
    stores = {site: ClientStateStore(tmp_path / "state", site, per_run=True) for site in SITES}
    for store in stores.values():
        store.use_run("job-1")
    return {site: SiteOptimizer(rule, args, store) for site, store in stores.items()}


def assert_same_bits(models: list[dict[str, np.ndarray]]) -> None:
    for model in models[1:]:
        assert model.keys() == models[0].keys()
        for key in model:
            assert model[key].dtype == models[0][key].dtype
            np.testing.assert_array_equal(model[key], models[0][key], err_msg=key)


def assert_close(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray], atol: float = 1e-6) -> None:
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape, key
        np.testing.assert_allclose(ours[key], theirs[key], rtol=0, atol=atol, err_msg=key)


#: How close the sites' x stays to the server rule's. The server sums p_i (y_i - x) in float32, the sites subtract x
#: from the mean rounded to float32: Delta differs by about an ulp of the model's values (~3e-8 here). FedAdagrad's
#: v never decays, so with eta / tau = 50 its step amplifies that difference most (1.9e-6 after three rounds).
ATOL = {"fedadam": 1e-6, "fedyogi": 1e-6, "fedavgm": 1e-6, "fedadagrad": 5e-6}
RULE_ARGS = {
    "fedadam": {"server_lr": 0.02, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
    "fedyogi": {"server_lr": 0.02, "tau": 1e-3},
    "fedadagrad": {"server_lr": 0.05},
    "fedavgm": {"server_lr": 1.0, "beta1": 0.9},
}


def test_the_site_step_rules_are_fedopts():
    from jobs.secure_aggregation import SITE_STEP_RULES

    assert set(SITE_STEP_RULES) == {rule.name for rule in FEDOPT_RULES} == set(RULE_ARGS)


@pytest.mark.parametrize("rule", sorted(RULE_ARGS))
def test_the_sites_hold_the_x_of_the_servers_rule_on_the_same_means(tmp_path, rule):
    """Three rounds: every site's x_r (what it trains from) is the same bits at every site and the plaintext rule's
    x_r to 1e-6; the model after the last round (one more step on the last mean) is the rule's x_3."""
    args = RULE_ARGS[rule]
    server, sites = Server(rule, args, initial_model()), optimizers(tmp_path, rule, args)
    received = initial_model()
    for round_num in range(ROUNDS):
        states = {site: opt.start_round(round_num, received) for site, opt in sites.items()}
        assert_same_bits([state.x for state in states.values()])
        assert len({state.digest for state in states.values()}) == 1
        assert_close(states["site-1"].x, server.x, ATOL[rule])
        assert states["site-1"].step == round_num
        models = {site: train(site, round_num, states[site].x) for site in SITES}
        for opt in sites.values():
            opt.record_result(round_num, TRAINABLE)
        server.aggregate(round_num, models)
        received = weighted_mean(models)
    finals = [opt.final_model(received, ROUNDS - 1) for opt in sites.values()]
    assert_same_bits(finals)
    assert_close(finals[0], server.x, ATOL[rule])
    assert finals[0]["bn.num_batches_tracked"] == 30  # buffers: the mean, typed like the model (rounded)
    assert any(not np.allclose(finals[0][key], initial_model()[key]) for key in TRAINABLE)


def test_the_step_is_the_rules_with_the_mean_as_its_only_update(tmp_path):
    """Not a re-derivation: FedAdam at a site is FedAdam.aggregate on (x, [ybar]) bit for bit."""
    opt = optimizers(tmp_path, "fedadam", RULE_ARGS["fedadam"])["site-1"]
    x = initial_model()
    state = opt.start_round(0, x)
    mean = {
        key: np.asarray(v).reshape(x[key].shape) for key, v in weighted_mean({s: train(s, 0, x) for s in SITES}).items()
    }
    stepped = opt.step(opt.record_result(0, TRAINABLE), mean)
    rule = build_rule("fedadam", **RULE_ARGS["fedadam"])
    update = ClientUpdate("mean", mean, 1, {meta_keys.PARAM_KEYS: TRAINABLE})
    expected = rule.aggregate(x, [update], rule.init_state(x), RoundContext(0, 1, ("mean",)))
    assert_same_bits([stepped.x, {k: np.asarray(v) for k, v in expected.params.items()}])
    assert stepped.step == 1 and state.step == 0


def test_a_restarted_site_continues_identically(tmp_path):
    """A site's optimizer keeps nothing in memory: a new process (a new optimizer on the same store) continues
    from the stored x and moments; a round delivered again (the site stopped after storing x_r) gives the same
    x_r without a second step; a lost store or a missed round is refused, naming the site."""
    args = RULE_ARGS["fedadam"]
    steady, restarted = optimizers(tmp_path / "a", "fedadam", args), optimizers(tmp_path / "b", "fedadam", args)
    received = initial_model()
    for round_num in range(ROUNDS):
        x = steady["site-1"].start_round(round_num, received).x
        again = optimizers(tmp_path / "b", "fedadam", args)["site-1"]  # a fresh process
        first = again.start_round(round_num, received)
        repeated = optimizers(tmp_path / "b", "fedadam", args)["site-1"].start_round(round_num, received)
        assert_same_bits([x, first.x, repeated.x])
        assert repeated.step == first.step == round_num
        models = {site: train(site, round_num, x) for site in SITES}
        steady["site-1"].record_result(round_num, TRAINABLE)
        restarted["site-1"].record_result(round_num, TRAINABLE)
        received = weighted_mean(models)
    with pytest.raises(SiteOptimizerError, match=r"^FedOpt at site-1: round 2 again with another global model"):
        restarted["site-1"].start_round(ROUNDS - 1, received)
    with pytest.raises(SiteOptimizerError, match=r"^FedOpt at site-1: its stored FedOpt state is of round 2, the "):
        restarted["site-1"].start_round(ROUNDS + 1, received)
    with pytest.raises(SiteOptimizerError, match=r"^FedOpt at site-2: no stored FedOpt state, but the server sends"):
        restarted["site-2"].start_round(1, received)
    with pytest.raises(
        SiteOptimizerError, match=r"written with \{'rule': 'fedadam'\}, this job runs \{'rule': 'fedyogi'"
    ):
        optimizers(tmp_path / "b", "fedyogi", args)["site-1"].start_round(ROUNDS, received)


def test_a_diverged_site_is_named_in_one_line():
    agreed = {site: {he_fedopt.DIGEST: "a" * 16, he_fedopt.DIGEST_ROUND: 2} for site in SITES}
    assert divergence_problem(2, agreed) is None
    odd = {**agreed, "site-2": {he_fedopt.DIGEST: "b" * 16, he_fedopt.DIGEST_ROUND: 2}}
    problem = divergence_problem(2, odd)
    assert problem == (
        f"FedOpt at the sites, round 2: the sites did not train from the same x and moments (site-2: digest "
        f"{'b' * 16}, the others {'a' * 16}); the job stops before aggregating"
    )
    stale = {**agreed, "site-3": {he_fedopt.DIGEST: "a" * 16, he_fedopt.DIGEST_ROUND: 1}}
    assert "site-3: no he_fedopt.digest of round 2" in divergence_problem(2, stale)
    split = {"site-1": agreed["site-1"], "site-2": odd["site-2"]}  # no majority: both are named
    assert "site-1: digest" in divergence_problem(2, split) and "site-2: digest" in divergence_problem(2, split)
    assert all("\n" not in p for p in (problem, divergence_problem(2, stale), divergence_problem(2, split)))


def test_a_site_that_stepped_from_another_state_is_caught_by_the_servers_check(tmp_path):
    """End to end in process: one site's store holds another x (a stale copy, another build's rounding); its
    digest differs, and NVFlare's consensus component at the server panics with the line naming it."""
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.app_constant import AppConstants
    from nvflare.app_common.app_event_type import AppEventType

    args = RULE_ARGS["fedadam"]
    sites = optimizers(tmp_path, "fedadam", args)
    x = initial_model()
    for site, opt in sites.items():
        tampered = {**x, "fc.weight": x["fc.weight"] + np.float32(1e-7)} if site == "site-3" else x
        opt.start_round(0, tampered)
    consensus = he_fedopt.SiteOptimizerConsensus()
    panics = []
    consensus.system_panic = lambda reason, fl_ctx: panics.append(reason)
    fl_ctx = FLContext()
    fl_ctx.set_prop(AppConstants.CURRENT_ROUND, 0, private=True, sticky=False)
    consensus.handle_event(AppEventType.ROUND_STARTED, fl_ctx)
    for site, opt in sites.items():
        state = opt.record_result(0, TRAINABLE)
        meta = {he_fedopt.DIGEST: state.digest, he_fedopt.DIGEST_ROUND: 0}
        result = DXO(DataKind.WEIGHTS, data={"w": np.ones(1)}, meta=meta).to_shareable()
        result.set_peer_props({ReservedKey.IDENTITY_NAME: site})
        fl_ctx.set_prop(AppConstants.TRAINING_RESULT, result, private=True, sticky=False)
        fl_ctx.set_prop(AppConstants.AGGREGATION_ACCEPTED, True, private=True, sticky=False)
        consensus.handle_event(AppEventType.AFTER_CONTRIBUTION_ACCEPT, fl_ctx)
    consensus.handle_event(AppEventType.BEFORE_AGGREGATION, fl_ctx)
    assert len(panics) == 1 and "(site-3: digest " in panics[0] and "site-1" not in panics[0]


def _site_context(tmp_path):
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.apis.fl_context import FLContext

    def context(site: str) -> FLContext:
        fl_ctx = FLContext()
        fl_ctx.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=True)
        fl_ctx.set_prop(ReservedKey.RUN_NUM, "job-1", private=False, sticky=True)
        return fl_ctx

    return context


def test_under_ckks_every_site_decrypts_the_same_bits_and_steps_alike(tmp_path, monkeypatch):
    """The HE path with TenSEAL (HEBuilder's parameters): each site encrypts n_i y_i with its own copy of the
    context, the server (no secret key) adds and scales by 1 / sum n_i, and every site runs NVFlare's
    HEModelDecryptor then the bundle's step filter; its result goes through the digest filter. Every site
    decrypts the same bits (another process too) and holds the same x; x stays within 1e-6 of the plaintext rule."""
    ts = pytest.importorskip("tenseal")
    from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
    from nvflare.app_common.app_constant import AppConstants
    from nvflare.app_opt.he.constant import HE_ALGORITHM_CKKS
    from nvflare.app_opt.he.model_decryptor import HEModelDecryptor

    monkeypatch.setenv("FLALGO_STATE_DIR", str(tmp_path / "state"))
    secret = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=8192, coeff_mod_bit_sizes=[60, 40, 40])
    secret.global_scale = 2**40
    site_bytes = secret.serialize(save_secret_key=True)
    server_context = ts.context_from(secret.serialize(save_secret_key=False))
    assert not server_context.is_private()
    args = RULE_ARGS["fedadam"]
    site_ctx = _site_context(tmp_path)
    decryptors, steps, digests = {}, {}, {}
    for site in SITES:
        decryptors[site] = HEModelDecryptor()
        decryptors[site].tenseal_context = ts.context_from(site_bytes)  # each site loads its own copy
        steps[site] = he_fedopt.SiteOptimizerStep("fedadam", args)
        digests[site] = he_fedopt.SiteOptimizerDigest("fedadam", args)
    server = Server("fedadam", args, initial_model())
    sent = DXO(DataKind.WEIGHTS, data=initial_model()).to_shareable()  # round 0 goes in clear
    total = sum(SAMPLES.values())
    for round_num in range(ROUNDS):
        xs, means, reports = {}, {}, {}
        for site in SITES:
            task = DXO(**_dxo_args(from_shareable(sent))).to_shareable()
            task.set_header(AppConstants.CURRENT_ROUND, round_num)
            task = decryptors[site].process(task, site_ctx(site))
            means[site] = {k: np.asarray(v) for k, v in from_shareable(task).data.items()}
            task = steps[site].process(task, site_ctx(site))
            xs[site] = from_shareable(task).data
        assert_same_bits(list(means.values()))
        assert_same_bits(list(xs.values()))
        assert_close(xs["site-1"], server.x)
        models, ciphertexts = {}, {}
        for site in SITES:
            models[site] = train(site, round_num, xs[site])
            meta = {meta_keys.NUM_SAMPLES: SAMPLES[site], meta_keys.PARAM_KEYS: TRAINABLE}
            result = DXO(DataKind.WEIGHTS, data=dict(models[site]), meta=meta).to_shareable()
            result.set_header(AppConstants.CURRENT_ROUND, round_num)
            reports[site] = from_shareable(digests[site].process(result, site_ctx(site))).meta
            encrypting = ts.context_from(site_bytes)
            ciphertexts[site] = {
                k: ts.ckks_vector(encrypting, (v.astype(np.float64).ravel() * SAMPLES[site]).tolist()).serialize()
                for k, v in models[site].items()
            }
        assert divergence_problem(round_num, reports) is None
        server.aggregate(round_num, models)
        mean = {}
        for key in ciphertexts["site-1"]:
            summed = sum(ts.ckks_vector_from(server_context, ciphertexts[s][key]) for s in SITES[1:])
            summed = ts.ckks_vector_from(server_context, ciphertexts["site-1"][key]) + summed
            mean[key] = (summed * (1.0 / total)).serialize()
        meta = {MetaKey.PROCESSED_KEYS: dict.fromkeys(mean, True), MetaKey.PROCESSED_ALGORITHM: HE_ALGORITHM_CKKS}
        sent = DXO(DataKind.WEIGHTS, data=mean, meta=meta).to_shareable()
    _assert_another_process_decrypts_the_same_bits(tmp_path, site_bytes, mean["fc.weight"])


def _dxo_args(dxo):
    return {"data_kind": dxo.data_kind, "data": dict(dxo.data), "meta": dict(dxo.meta)}


def _assert_another_process_decrypts_the_same_bits(tmp_path, site_bytes, ciphertext) -> None:
    """The last mean's fc.weight decrypted in a separate Python process: the same float64 bits as in this one."""
    import tenseal as ts

    (tmp_path / "site.tenseal").write_bytes(site_bytes)
    (tmp_path / "fc.ct").write_bytes(ciphertext)
    code = (
        "import sys, hashlib, numpy as np, tenseal as ts; c = ts.context_from(open(sys.argv[1], 'rb').read()); "
        "v = ts.ckks_vector_from(c, open(sys.argv[2], 'rb').read()).decrypt(); "
        "print(hashlib.sha256(np.asarray(v, dtype=np.float64).tobytes()).hexdigest())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "site.tenseal"), str(tmp_path / "fc.ct")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    here = np.asarray(ts.ckks_vector_from(ts.context_from(site_bytes), ciphertext).decrypt(), dtype=np.float64)
    assert done.stdout.strip() == hashlib.sha256(here.tobytes()).hexdigest()


# -- the job ---------------------------------------------------------------------------------------------------------
def _filters(chain: list) -> list[str]:
    return [f["path"] for entry in chain for f in entry["filters"]]


@pytest.mark.parametrize("mode", ["he", "plain"])
def test_the_job_steps_at_the_sites_after_decryption_and_checks_at_the_server(tmp_path, mode):
    from jobs.build import JobSpec, export_job

    args = {"server_lr": 0.02, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    job = export_job(JobSpec(name="fedadam_he", secure_aggregation=mode, server="fedadam", server_args=args), tmp_path)
    config = job / "app" / "config"
    server, site = (json.loads((config / f"config_fed_{s}.json").read_text()) for s in ("server", "client"))
    he = ["nvflare.app_opt.he.model_decryptor.HEModelDecryptor"] if mode == "he" else []
    assert _filters(site["task_data_filters"]) == [*he, "controllers.he_fedopt.SiteOptimizerStep"]
    encryptor = ["nvflare.app_opt.he.model_encryptor.HEModelEncryptor"] if mode == "he" else []
    assert _filters(site["task_result_filters"]) == [
        "controllers.he_fedopt.SiteOptimizerDigest",
        "controllers.secure_aggregation.SampleCountWeight",
        *encryptor,
        "aggregators.contracts.egress_gate.EgressGate",  # last on train, then the validate chain
        "aggregators.contracts.egress_gate.EgressGate",
    ]
    step = next(f for e in site["task_data_filters"] for f in e["filters"] if f["path"].endswith("OptimizerStep"))
    assert step["args"] == {"server": "fedadam", "server_args": args}
    assert "controllers.he_fedopt.SiteOptimizerConsensus" in [c["path"] for c in server["components"]]
    assert server["workflows"][0]["args"]["min_clients"] == 3


@pytest.mark.parametrize(
    ("settings", "refused"),
    [
        (
            {"server_args": {"weighting": "uniform"}},
            "secure_aggregation 'he' with server 'fedadam': server_args weighting 'uniform': the sites step on the "
            "mean NVFlare's aggregator forms, weighted by train.num_samples; allowed: samples",
        ),
        (
            {"min_responses": 2},
            "secure_aggregation 'he' with server 'fedadam': min_responses 2: every site takes the FedOpt step and "
            "must train every round, so every round waits for all 3 sites; allowed: unset or 3",
        ),
        ({"clients_per_round": 2}, "secure_aggregation 'he': clients_per_round: ScatterAndGather trains every site"),
        (
            {"server_args": {"tau": 0.0}},
            "--server-args: fedadam: hyperparameter 'tau' must be a finite number >= 1e-12",
        ),
        ({"server_args": {"momentum": 0.9}}, "--server-args: fedadam has no setting 'momentum'; allowed: server_lr"),
    ],
)
def test_settings_the_site_step_cannot_carry_are_refused_in_one_line(settings, refused):
    from jobs.build import JobBuildError, JobSpec

    with pytest.raises(JobBuildError) as caught:
        JobSpec(name="he", secure_aggregation="he", server="fedadam", **settings)
    assert str(caught.value).startswith(refused) and "\n" not in str(caught.value)


def test_a_site_turns_the_servers_saved_mean_into_fedopts_final_model(tmp_path, capsys):
    """``python -m jobs.fedopt_final``: the saved model is the last mean; one step from the site's stored state of
    the last round gives the plaintext rule's x_T (a one-round plain job of LeNet-5 here)."""
    import torch
    from nvflare.fuel.utils.class_utils import instantiate_class

    from jobs.build import JobSpec, export_job
    from jobs.fedopt_final import main

    args = RULE_ARGS["fedadam"]
    job = export_job(
        JobSpec(name="final", secure_aggregation="plain", server="fedadam", server_args=args, num_rounds=1), tmp_path
    )
    server_config = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    entry = next(c for c in server_config["components"] if c["id"] == "persistor")["args"]["model"]
    x0 = {k: v.numpy() for k, v in instantiate_class(entry["path"], entry["args"]).state_dict().items()}
    store = ClientStateStore(tmp_path / "state", "site-1")
    x = SiteOptimizer("fedadam", args, store).start_round(0, x0).x
    rng = np.random.default_rng(3)
    models = {s: {k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in x.items()} for s in SITES}
    mean = {k: sum(SAMPLES[s] / sum(SAMPLES.values()) * models[s][k].astype(np.float64) for s in SITES) for k in x}
    torch.save({"model": {k: torch.from_numpy(v.astype(np.float32)) for k, v in mean.items()}}, tmp_path / "saved.pt")
    out = tmp_path / "final.pt"
    argv = [str(tmp_path / "saved.pt"), "--job", str(job), "--state", str(tmp_path / "state"), "--site", "site-1"]
    assert main([*argv, "--out", str(out)]) == 0
    final = {k: v.numpy() for k, v in torch.load(out).items()}
    server = Server("fedadam", args, x0)
    updates = [ClientUpdate(s, models[s], SAMPLES[s]) for s in SITES]
    expected = server.rule.aggregate(x0, updates, server.state, RoundContext(0, 1, SITES)).params
    assert_close(final, dict(expected))
    assert main([*argv, "--site", "site-2", "--out", str(out)]) == 2
    assert (
        "error: FedOpt at site-2: the final model needs the state of round 0; stored: none" in capsys.readouterr().err
    )
