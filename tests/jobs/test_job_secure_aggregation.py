"""``--secure-aggregation he``: what is refused at build time (one line, naming the setting and why), what the
exported job wires (NVFlare's HE components, as NVFlare's own FedAvgRecipeWithHE does), the loopback project with
HEBuilder, and a site's decryption of the saved global model. The run itself: tests/e2e/test_e2e_secure_aggregation.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from aggregators.fedavg import FedAvg
from aggregators.registry import RULES
from aggregators.types import UNDECLARED_SECURE_SUM, declared_secure_sum
from jobs import secure_aggregation
from jobs.build import JOBS_DIR, JobBuildError, JobSpec, export_job, main
from jobs.secure_aggregation import (
    CLIENT_REFUSALS,
    HE_COMPONENTS,
    RULE_REFUSALS,
    SITE_STEP_RULES,
    SUM_CLIENTS,
    SUM_RULES,
    is_he_job,
)
from lightning_modules.algorithms import CLIENT_ALGORITHMS, capabilities
from lightning_modules.algorithms.fedprox import FedProx


def _paths(config: object) -> list[str]:
    """Every component class path named anywhere in a config, in order."""
    if isinstance(config, dict):
        own = [config["path"]] if isinstance(config.get("path"), str) else []
        return own + [p for value in config.values() for p in _paths(value)]
    if isinstance(config, list):
        return [p for value in config for p in _paths(value)]
    return []


def _configs(job_dir: Path) -> tuple[dict, dict]:
    config = job_dir / "app" / "config"
    return tuple(json.loads((config / f"config_fed_{side}.json").read_text()) for side in ("server", "client"))


def test_every_rule_is_admitted_or_refused_with_its_reason():
    assert set(RULE_REFUSALS) == set(RULES) - set(SUM_RULES) - set(SITE_STEP_RULES)
    assert set(CLIENT_REFUSALS) == set(CLIENT_ALGORITHMS) - set(SUM_CLIENTS)


def test_what_runs_on_sums_is_what_the_classes_declare():
    assert SUM_RULES == ("fedavg",)
    assert SITE_STEP_RULES == ("fedadam", "fedyogi", "fedadagrad", "fedavgm")
    assert SUM_CLIENTS == ("fedavg", "fedprox")
    assert CLIENT_REFUSALS["apfl"] == capabilities.PER_SITE_STATE  # a personal model, no line of its own


class ClippedFedAvg(FedAvg):
    """A contributor's rule that clips every update before averaging: it needs the individual updates."""

    name = "clipped_fedavg"


class QuietFedProx(FedProx):
    """A contributor's client that may need more from the server than FedProx did."""

    name = "quiet_fedprox"


def test_a_subclass_does_not_inherit_its_parents_admission():
    assert declared_secure_sum(FedAvg) == "sum" and declared_secure_sum(ClippedFedAvg) == UNDECLARED_SECURE_SUM
    assert capabilities.declared_secure_sum(FedProx) is None
    assert capabilities.declared_secure_sum(QuietFedProx) == capabilities.UNDECLARED_SECURE_SUM


def test_an_undeclared_rule_subclass_is_refused_at_build_time(monkeypatch):
    monkeypatch.setitem(RULES, ClippedFedAvg.name, ClippedFedAvg)
    secure_aggregation._derived_tables.cache_clear()
    try:
        with pytest.raises(JobBuildError, match="the rule declares no secure_sum of its own"):
            JobSpec(name="he", server=ClippedFedAvg.name, secure_aggregation="he")
    finally:
        monkeypatch.undo()
        secure_aggregation._derived_tables.cache_clear()


@pytest.mark.parametrize("rule", sorted(RULE_REFUSALS))
def test_a_rule_that_needs_individual_updates_is_refused(rule):
    with pytest.raises(JobBuildError) as refused:
        JobSpec(name="he", server=rule, secure_aggregation="he")
    message = str(refused.value)
    assert message.startswith(f"secure_aggregation 'he' with server '{rule}': the rule {RULE_REFUSALS[rule]}")
    assert message.endswith("allowed: fedavg, fedadam, fedyogi, fedadagrad, fedavgm") and "\n" not in message


@pytest.mark.parametrize("client", sorted(CLIENT_REFUSALS))
def test_a_client_algorithm_that_needs_the_bundles_controller_is_refused(client):
    with pytest.raises(JobBuildError, match=rf"^secure_aggregation 'he' with client '{client}': the algorithm "):
        JobSpec(name="he", client=client, secure_aggregation="he")


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"server_args": {"server_lr": 0.5}}, "server_args"),
        ({"attack": "sign_flip", "malicious_sites": "site-1"}, "attack settings"),
        ({"clients_per_round": 2}, "clients_per_round"),
        ({"min_accepted": 2}, "min_accepted"),
        ({"save_client_updates": True}, "save_client_updates"),
        ({"max_test_samples": 100}, "max_test_samples"),
        ({"local_keys": "net.fc3.*"}, "local_keys"),
    ],
)
def test_settings_the_sum_workflow_cannot_carry_are_refused_by_name(settings, named):
    for mode in ("he", "plain"):
        with pytest.raises(JobBuildError, match=rf"^secure_aggregation '{mode}': {named}: "):
            JobSpec(name="he", secure_aggregation=mode, **settings)


#: A user's own LightningModule and data module (examples/custom_model), as ``--model/--data/--ship`` give them.
USER_MODEL = {
    "model": "custom_model.model:DigitsClassifier",
    "data": "custom_model.data:DigitsSites",
    "ship": str(JOBS_DIR.parent / "examples" / "custom_model"),
}


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"script": str(JOBS_DIR.parent / "examples" / "custom_model" / "train_script.py")}, "--script"),
        ({"devices": 2}, "devices"),
    ],
)
def test_a_user_model_run_differently_than_by_the_bundles_client_on_one_device_is_refused(settings, named):
    for mode in ("he", "plain"):
        with pytest.raises(JobBuildError, match=rf"^secure_aggregation '{mode}': {named}: "):
            JobSpec(name="he", secure_aggregation=mode, **USER_MODEL, **settings)


def test_a_user_model_job_ships_its_package_and_the_server_builds_the_users_model(tmp_path):
    """``--model/--data`` under HE: the same HE components and filters as a built-in job; the persistor builds the
    user's module with the job's seed (the encrypted global model's shapes come from it), and the shipped package
    reaches the server and the sites."""
    spec = JobSpec(name="he_user", secure_aggregation="he", client="fedprox", client_args={"mu": 0.01}, **USER_MODEL)
    job = export_job(spec, tmp_path)
    server, site = _configs(job)
    assert set(HE_COMPONENTS) <= set(_paths(server) + _paths(site))
    persistor = next(c for c in server["components"] if c["id"] == "persistor")["args"]["model"]
    assert persistor == {
        "path": "lightning_modules.own_model.seeded_user_module",
        "args": {"model": USER_MODEL["model"], "model_args": {}, "seed": 0},
    }
    assert _paths(site["task_result_filters"]) == [
        "controllers.secure_aggregation.SampleCountWeight",
        "nvflare.app_opt.he.model_encryptor.HEModelEncryptor",
        "aggregators.contracts.egress_gate.EgressGate",  # last on train, then the validate chain
        "aggregators.contracts.egress_gate.EgressGate",
    ]
    assert (job / "app" / "custom" / "custom_model" / "model.py").is_file()
    executor = site["executors"][0]["executor"]["args"]
    assert f"--model {USER_MODEL['model']}" in executor["task_script_args"]
    assert f"--data {USER_MODEL['data']}" in executor["task_script_args"]


def test_a_dp_sgd_job_gives_its_sites_the_round_meta_their_ledger_keys_on(tmp_path):
    """DP-SGD under HE: after NVFlare's decryptor, the site's own filter puts the run id, the round and the planned
    rounds into the received model's meta (tests/lightning_modules/test_lm_privacy_sum_workflow.py runs the rounds),
    and the server's filter sends what each site released; a job without DP-SGD has neither filter."""
    pytest.importorskip("opacus")
    private = JobSpec(name="he_dp", secure_aggregation="he", dp_target_epsilon=8.0, dp_max_grad_norm=1.0)
    server, site = _configs(export_job(private, tmp_path))
    assert _paths(site["task_data_filters"]) == [
        "nvflare.app_opt.he.model_decryptor.HEModelDecryptor",
        "controllers.secure_aggregation.SumWorkflowRound",
    ]
    assert "--dp-target-epsilon 8.0" in site["executors"][0]["executor"]["args"]["task_script_args"]
    assert _paths(server["task_data_filters"]) == ["controllers.secure_aggregation.ReleasedStepsBroadcast"]
    plain_server, plain_site = _configs(export_job(JobSpec(name="he", secure_aggregation="he"), tmp_path))
    assert "controllers.secure_aggregation.SumWorkflowRound" not in _paths(plain_site)
    assert "controllers.secure_aggregation.ReleasedStepsBroadcast" not in _paths(plain_server)


def test_the_round_records_summarise_the_sites_scores_of_the_received_model():
    """Under HE the server cannot score the model; the sites' ``eval.*`` meta (in clear) is summarised per round as
    the bundle's controller does, weighted by ``train.num_samples``."""
    from controllers.engine import site_eval_summary
    from controllers.secure_aggregation import site_scores

    scores = [
        site_scores("site-1", {"eval.val_accuracy": 0.5, "train.num_samples": 100, "train.loss": 0.3}),
        site_scores("site-2", {"eval.val_accuracy": 0.9, "train.num_samples": 300}),
        site_scores("site-3", {"train.num_samples": 50}),  # no validation split: no scores
    ]
    summary = site_eval_summary(scores)
    assert list(summary) == ["val_accuracy"]
    assert summary["val_accuracy"]["per_site"] == {"site-1": 0.5, "site-2": 0.9}
    assert summary["val_accuracy"]["mean"] == pytest.approx(0.8) and summary["val_accuracy"]["worst_site"] == "site-1"


def test_the_builder_refuses_in_one_line(capsys):
    assert main(["--secure-aggregation", "he", "--server", "median", "--output-dir", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: secure_aggregation 'he' with server 'median': the rule takes the coordinate-wise")
    assert "\n" not in err
    assert main(["--secure-aggregation", "rsa", "--output-dir", "/nonexistent"]) == 2
    refusal = "unknown secure_aggregation 'rsa'; choose one of ['none', 'he', 'plain', 'secagg']"
    assert refusal in capsys.readouterr().err


@pytest.mark.parametrize("client", SUM_CLIENTS)
def test_the_he_job_wires_nvflares_he_components_around_the_bundles_client(client, tmp_path):
    client_args = {"mu": 0.01} if client == "fedprox" else {}
    spec = JobSpec(name=f"he_{client}", client=client, client_args=client_args, secure_aggregation="he")
    job = export_job(spec, tmp_path)
    server, site = _configs(job)
    named = _paths(server) + _paths(site)
    assert set(HE_COMPONENTS) <= set(named)
    assert server["workflows"][0]["path"] == "nvflare.app_common.workflows.scatter_and_gather.ScatterAndGather"
    assert "controllers.fedalg_controller.FedAlgController" not in named
    assert "controllers.evaluator.TestSetEvaluator" not in named  # the server never holds the model in clear
    # The weight is set before the encryptor multiplies by it; the egress gate sees the encrypted result last.
    result_filters = _paths(site["task_result_filters"])
    assert result_filters == [
        "controllers.secure_aggregation.SampleCountWeight",
        "nvflare.app_opt.he.model_encryptor.HEModelEncryptor",
        "aggregators.contracts.egress_gate.EgressGate",  # last on train, then the validate chain
        "aggregators.contracts.egress_gate.EgressGate",
    ]
    executor = site["executors"][0]["executor"]["args"]
    assert executor["task_script_path"] == "client.py" and f"--client {client}" in executor["task_script_args"]
    assert "tenseal" in (job / "app" / "custom" / "site_requirements.txt").read_text()
    assert is_he_job(job)


def test_the_plain_twin_is_the_same_workflow_without_encryption(tmp_path):
    job = export_job(JobSpec(name="plain", secure_aggregation="plain"), tmp_path)
    server, site = _configs(job)
    named = _paths(server) + _paths(site)
    assert not any(path.startswith("nvflare.app_opt.he.") for path in named)
    assert "nvflare.app_common.aggregators.intime_accumulate_model_aggregator.InTimeAccumulateWeightedAggregator" in (
        named
    )
    assert _paths(site["task_result_filters"]) == [
        "controllers.secure_aggregation.SampleCountWeight",
        "aggregators.contracts.egress_gate.EgressGate",  # last on train, then the validate chain
        "aggregators.contracts.egress_gate.EgressGate",
    ]
    assert not is_he_job(job) and not is_he_job(JOBS_DIR / "fedavg")


def test_the_he_job_uses_the_same_nvflare_components_as_nvflares_he_recipe(tmp_path):
    """NVFlare's FedAvgRecipeWithHE, built with the same model: every HE component and the workflow it wires, ours
    wires too (our additions: the weight filter and the round records)."""
    from nvflare.app_opt.pt.recipes.fedavg_he import FedAvgRecipeWithHE

    from jobs.assembly import builtin_model_config, inside_directory

    spec = JobSpec(name="ours", secure_aggregation="he")
    with inside_directory(JOBS_DIR):
        recipe = FedAvgRecipeWithHE(
            name="nvflare_he", model=builtin_model_config(spec), min_clients=3, train_script="client.py"
        )
        recipe.export(str(tmp_path / "recipe"))
    theirs = _configs(tmp_path / "recipe" / "nvflare_he")
    ours = _configs(export_job(spec, tmp_path / "ours"))
    for their_config, our_config in zip(theirs, ours, strict=True):
        wanted = {p for p in _paths(their_config) if p.startswith(("nvflare.app_opt.he.", "nvflare.app_common.work"))}
        assert wanted <= set(_paths(our_config))


def test_the_committed_he_job_is_an_he_job_and_no_simulation_grid_runs_it():
    from jobs.presets import PRESETS

    assert PRESETS["fedavg_he"].secure_aggregation == "he" and is_he_job(JOBS_DIR / "fedavg_he")
    assert "fedavg_he" not in PRESETS.with_builtin_model()


def test_the_loopback_project_gets_hebuilder_before_the_signatures(tmp_path):
    import yaml

    from jobs.provision.loopback import HE_BUILDER, write_project

    builders = [
        b["path"]
        for b in yaml.safe_load(write_project(tmp_path / "he.yml", 8002, ["a"], he=True).read_text())["builders"]
    ]
    assert builders.index(HE_BUILDER) == builders.index("nvflare.lighter.impl.signature.SignatureBuilder") - 1
    plain = yaml.safe_load(write_project(tmp_path / "plain.yml", 8002, ["a"]).read_text())["builders"]
    assert HE_BUILDER not in [b["path"] for b in plain]


def test_the_weight_filter_sets_nvflares_weight_to_the_sample_count():
    from nvflare.apis.dxo import DXO, DataKind, MetaKey

    from aggregators.contracts import meta_keys
    from controllers.secure_aggregation import SampleCountWeight

    dxo = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}, meta={meta_keys.NUM_SAMPLES: 273})
    assert SampleCountWeight().process_dxo(dxo, None, None).get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) == 273
    with pytest.raises(ValueError, match=r"train\.num_samples"):
        SampleCountWeight().process_dxo(DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}), None, None)


def test_a_site_decrypts_the_saved_model_and_the_servers_context_cannot(tmp_path):
    """The saved global model as NVFlare's HE serialize filter leaves it (serialised CKKS vectors): decrypted with a
    site's context (secret key), refused with the server's (public part only). TenSEAL is used, not re-implemented."""
    ts = pytest.importorskip("tenseal")
    import torch

    from jobs.secure_aggregation import decrypt_global_model

    context = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=8192, coeff_mod_bit_sizes=[60, 40, 40])
    context.global_scale = 2**40
    weights = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    saved = {"model": {"w": ts.ckks_vector(context, weights.ravel().tolist()).serialize(), "b": torch.ones(2)}}
    torch.save(saved, tmp_path / "FL_global_model.pt")
    (tmp_path / "site.tenseal").write_bytes(context.serialize(save_secret_key=True))
    (tmp_path / "server.tenseal").write_bytes(context.serialize(save_secret_key=False))
    model = decrypt_global_model(tmp_path / "FL_global_model.pt", tmp_path / "site.tenseal", {"w": (3, 4), "b": (2,)})
    np.testing.assert_allclose(model["w"], weights, atol=1e-5)
    np.testing.assert_array_equal(model["b"], np.ones(2, np.float32))
    with pytest.raises(ValueError, match="holds no secret key"):
        decrypt_global_model(tmp_path / "FL_global_model.pt", tmp_path / "server.tenseal", {"w": (3, 4)})


def test_stopping_a_deployment_never_signals_the_command_that_started_it(tmp_path):
    """``make poc POC_WS=<folder>``: make's own command line names the workspace, as the deployment's job processes'
    do; the driver must not count make (or any other ancestor) among the processes it stops."""
    import subprocess
    import sys

    workspace = tmp_path / "fedalg-loopback-ws"
    code = (
        "import sys; from pathlib import Path; from jobs.provision.loopback import Deployment, _deployment_processes; "
        "d = Deployment(Path(sys.argv[1]), Path('s'), {}, Path('a'), 0); "
        "print([p.pid for p in _deployment_processes(d)])"
    )
    shell = f'"{sys.executable}" -c "{code}" "$0"'
    done = subprocess.run(["bash", "-c", shell, str(workspace)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
