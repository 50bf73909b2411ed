"""``python jobs/<name>/job.py`` (`jobs.job_entry`): every exported job folder records the spec it was built from
(`jobs.job_record`) and runs it with NVFlare's recipe API in SimEnv, PocEnv or ProdEnv.

One definition: the recipe that job.py builds exports the folder it sits in, file for file, and the folder in
``nvflare simulator`` and its job.py in SimEnv train bit-identical models (a tiny SCAFFOLD job: digits, MLP, 3 sites,
2 rounds, shared with the TensorBoard and report checks). Bad input is refused in one line before anything starts.
"""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from controllers import report
from controllers.checkpoint import params_digest
from jobs import job_entry
from jobs.build import JobSpec, export_job
from jobs.job_record import JOB_SCRIPT, SPEC_FILE, recorded_spec
from jobs.recipe import FedAlgRecipe
from jobs.run_output import is_progress, quiet_output

REPO = Path(__file__).resolve().parents[2]
NVFLARE = Path(sys.executable).with_name("nvflare")
TINY = JobSpec(name="recipe_sim", client="scaffold", server="scaffold", num_rounds=2, dataset="digits", arch="mlp")
TRAINING = ("stage", "round", "sites", "aggregated", "global_sha256", "test_accuracy")
#: The file in the fixture's folder that holds what the run printed on its terminal.
TERMINAL = "terminal.txt"


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def assert_same_tree(exported: Path, folder: Path) -> None:
    assert _files(exported) == _files(folder)
    for path in _files(folder):
        assert filecmp.cmp(exported / path, folder / path, shallow=False), path


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory) -> tuple[Path, Path]:
    """`TINY` exported as a job folder and run through its own job.py in SimEnv: (folder, result workspace)."""
    root = tmp_path_factory.mktemp("recipe")
    folder = export_job(TINY, root / "jobs")
    with quiet_output(root / TERMINAL):  # what job.py shows on the terminal, kept for the output test
        code = job_entry.main(folder, ["--workspace", str(root / "sim")])
    assert code == 0
    return folder, root / "sim" / TINY.name


def _metrics(workspace: Path) -> list[dict]:
    return report.load_records(workspace)


def test_job_py_runs_in_simenv_and_streams_tensorboard_curves(recipe_run):
    _, workspace = recipe_run
    server = workspace / "server" / "simulate_job"
    records = _metrics(workspace)
    assert [r["round"] for r in records if r["stage"] == "round"] == [0, 1]
    assert all(r["aggregated"] == ["site-1", "site-2", "site-3"] for r in records if r["stage"] == "round")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for site in ("site-1", "site-2", "site-3"):
        events = EventAccumulator(str(server / "tb_events" / site))
        events.Reload()
        assert {"train_loss", "train_accuracy"} <= set(events.Tags()["scalars"]), site
        losses = events.Scalars("train_loss")
        assert [e.step for e in losses] == [0, 1]
        logged = {r["round"]: r["site_train_loss"][site] for r in records if r["stage"] == "round"}
        assert [e.value for e in losses] == pytest.approx([logged[0], logged[1]], rel=1e-6)


def test_job_py_shows_the_rounds_as_make_demo_does_and_keeps_the_rest_in_its_log(recipe_run):
    """NVFlare's whole output (about 280 lines for 5 rounds) went to the terminal; now only what make demo shows."""
    _, workspace = recipe_run
    printed = (workspace.parent.parent / TERMINAL).read_text().splitlines()
    log = workspace.parent / f"{TINY.name}.log"
    assert printed[0] == f"SimEnv: 2 rounds, 3 sites in {workspace} (full log: {log}; --verbose prints it)"
    assert printed[-2:] == [f"result: {workspace}", f"summary: python -m controllers.report {workspace}"]
    assert all(is_progress(line) for line in printed[1:-2]), printed
    rounds = [line.split(" - ")[-1] for line in printed if ": training on " in line]
    assert rounds == [f"round {r}/2: training on ['site-1', 'site-2', 'site-3']" for r in (1, 2)]
    written = log.read_text().splitlines()
    assert set(printed[1:-2]) <= set(written) and len(written) > 5 * len(printed)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], "{workspace}/recipe_sim.log"), (["--verbose"], None), (["--env", "poc"], None)],
)
def test_the_output_is_kept_in_a_log_beside_the_run_unless_verbose_or_not_in_simenv(argv, expected, tmp_path):
    args = job_entry.build_parser(TINY, "recipe_sim").parse_args([*argv, "--workspace", str(tmp_path)])
    log = job_entry.output_log(args, TINY)
    assert log == (None if expected is None else Path(expected.format(workspace=tmp_path)))


def test_the_folder_and_its_job_py_train_bit_identical_models(recipe_run, tmp_path):
    folder, recipe_workspace = recipe_run
    workspace = tmp_path / "ws"
    command = [str(NVFLARE), "simulator", str(folder), "-w", str(workspace), "-n", "3", "-t", "3"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    simulated, recipe = _metrics(workspace), _metrics(recipe_workspace)

    assert [[r.get(k) for k in TRAINING] for r in recipe] == [[r.get(k) for k in TRAINING] for r in simulated], (
        completed.stdout[-2000:]
    )
    assert len({r["global_sha256"] for r in simulated}) == TINY.num_rounds + 1  # every round changed the model
    finals = []
    for run in (workspace, recipe_workspace):
        saved = torch.load(run / "server/simulate_job/app_server/FL_global_model.pt", weights_only=False)
        finals.append(params_digest({key: np.asarray(value) for key, value in saved["model"].items()}))
    assert finals[0] == finals[1] == simulated[-1]["global_sha256"]


def test_report_reads_the_recipe_run_and_names_it_under_the_workspace_root(recipe_run, tmp_path, capsys):
    _, workspace = recipe_run
    assert report.main([str(workspace), "--plot", str(tmp_path / "p.png")]) == 0
    table = capsys.readouterr().out
    assert TINY.name in table and (tmp_path / "p.png").is_file()
    # The folder given to --workspace holds one run per job name: the report names the run to pick.
    assert report.main([str(workspace.parent)]) == 2
    assert f"it holds runs: {workspace}: name one" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["scaffold", "fedavg_he"])
def test_job_py_builds_the_recipe_that_exports_its_own_folder(name, tmp_path):
    folder = REPO / "jobs" / name
    FedAlgRecipe.from_spec(recorded_spec(folder)).export(tmp_path)
    assert_same_tree(tmp_path / name, folder)
    assert (folder / JOB_SCRIPT).is_file() and (folder / SPEC_FILE).is_file()


def test_shipped_code_is_recorded_as_the_folders_own_copies(tmp_path, monkeypatch):
    """A job with the user's package and training script shipped, moved elsewhere and the originals deleted: its
    record names its own copies, and the recipe built from it exports the moved folder file for file."""
    # Not under test, and a site-like subprocess per validation: the check that shipped packages import at a site.
    monkeypatch.setattr("jobs.user_checks.site_import_problem", lambda spec: None)
    source = tmp_path / "src"
    shutil.copytree(REPO / "examples" / "custom_model", source / "custom_model")
    shutil.copy(source / "custom_model" / "train_script.py", source / "train.py")
    spec = JobSpec(
        name="own",
        model="custom_model.model:DigitsClassifier",
        script=str(source / "train.py"),
        ship=str(source / "custom_model"),
    )
    moved = Path(shutil.move(export_job(spec, tmp_path / "jobs"), tmp_path / "elsewhere" / "own"))
    shutil.rmtree(source)

    settings = json.loads((moved / SPEC_FILE).read_text())["settings"]
    assert (settings["ship"], settings["script"]) == ("app/custom/custom_model", "app/custom/train.py")
    FedAlgRecipe.from_spec(recorded_spec(moved)).export(tmp_path / "again")
    assert_same_tree(tmp_path / "again" / "own", moved)


@pytest.fixture(scope="module")
def kits(tmp_path_factory) -> Path:
    """Real startup kits of the bundle's project (``nvflare provision -p jobs/provision/project.yml``)."""
    workspace = tmp_path_factory.mktemp("provision")
    command = [str(NVFLARE), "provision", "-p", str(job_entry.PROJECT_FILE), "-w", str(workspace)]
    subprocess.run(command, check=True, capture_output=True, timeout=120, cwd=workspace)
    return workspace / job_entry.bundle_project() / "prod_00"


class Started(Exception):
    pass


@pytest.fixture
def started(monkeypatch) -> list:
    """The environments a job was started in (none: bad input must start nothing); each start stops at once."""
    envs = []

    def execute(recipe, env):
        envs.append(env)
        raise Started

    monkeypatch.setattr(FedAlgRecipe, "execute", execute)
    return envs


def other_project_kit(kits: Path, tmp_path: Path) -> Path:
    kit = Path(shutil.copytree(kits / "admin@fedalg.org", tmp_path / "admin@other.org"))
    config = json.loads((kit / "startup" / "fed_admin.json").read_text())
    config["admin"]["project_name"] = "other"
    (kit / "startup" / "fed_admin.json").write_text(json.dumps(config))
    return kit


@pytest.mark.parametrize(
    ("job", "argv", "expected"),
    [
        ("fedavg", ["--env", "cloud"], "argument --env: invalid choice: 'cloud' (choose from"),
        ("fedavg", ["--env", "prod"], "error: --startup-kit: --env prod needs the admin's startup kit folder"),
        ("fedavg", ["--env", "prod", "--startup-kit", "{kits}/site-1"], "site-1: not an admin startup kit"),
        ("fedavg", ["--env", "prod", "--startup-kit", "{tmp}/missing"], "missing: not an admin startup kit"),
        (
            "fedavg",
            ["--env", "prod", "--startup-kit", "{other}"],
            "a kit of project 'other', expected project 'fedalg'",
        ),
        ("fedavg", ["--startup-kit", "{kits}/admin@fedalg.org"], "--startup-kit/--project: only for --env prod"),
        ("fedavg", ["--env", "poc", "--threads", "2"], "--threads: only for --env sim, got --env poc"),
        ("fedavg", ["--env", "poc", "--verbose"], "--verbose: only for --env sim (poc and prod print their output"),
        ("fedavg_he", [], "--env sim: this job aggregates under homomorphic encryption"),
    ],
)
def test_bad_input_is_one_line_and_starts_nothing(job, argv, expected, kits, tmp_path, started, capsys):
    paths = {"kits": kits, "tmp": tmp_path, "other": other_project_kit(kits, tmp_path)}
    try:
        code = job_entry.main(REPO / "jobs" / job, [a.format(**paths) for a in argv])
    except SystemExit as exc:  # argparse's own refusals (an unknown --env)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert started == []


@pytest.mark.parametrize("project", [None, "other"])
def test_prod_submits_as_the_kits_admin_of_the_expected_project(project, kits, tmp_path, started):
    kit = kits / "admin@fedalg.org" if project is None else other_project_kit(kits, tmp_path)
    argv = ["--env", "prod", "--startup-kit", str(kit)] + (["--project", project] if project else [])
    with pytest.raises(Started):
        job_entry.main(REPO / "jobs" / "fedavg", argv)
    (env,) = started
    assert (env.username, env.startup_kit_location) == ("admin@fedalg.org", str(kit.resolve()))


def test_poc_sites_run_this_python_and_derive_their_shards_unless_their_data_is_set(tmp_path):
    """A POC site is provisioned (startup/fed_client.json), so it refuses to derive data on its own; job.py --env poc
    opts its sites in, as the simulator's, and leaves a site data setting the user made alone."""
    from data_prep.site_config import SITE_DATA_ENV, SiteDataError, resolve_site_data
    from data_prep.sites import SiteDataConfig, site_split

    site = tmp_path / "site-2"
    (site / "startup").mkdir(parents=True)
    (site / "startup" / "fed_client.json").write_text("{}")
    simulation = SiteDataConfig(dataset="digits", scheme="dirichlet", num_sites=3)
    with pytest.raises(SiteDataError, match="no site-local training data"):
        resolve_site_data("site-2", site, simulation, 10, environ={})

    environ = {"PATH": "/usr/bin"}
    job_entry.poc_site_environment(environ)
    assert environ["PATH"] == f"{Path(sys.executable).parent}:/usr/bin"
    data = resolve_site_data("site-2", site, simulation, 10, environ=environ)
    expected_x, expected_y = site_split(simulation, "site-2")
    np.testing.assert_array_equal(data.y, expected_y)
    np.testing.assert_array_equal(data.x, expected_x)

    own = {"PATH": "", SITE_DATA_ENV: "/data/site.npz"}
    job_entry.poc_site_environment(own)
    assert own[SITE_DATA_ENV] == "/data/site.npz"


def test_the_job_py_in_a_committed_folder_runs_its_folders_job(monkeypatch, capsys, started):
    """The file itself, as ``python jobs/fedavg/job.py --env prod`` runs it: its folder's job, refused without a kit."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["job.py", "--env", "prod"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(REPO / "jobs" / "fedavg" / JOB_SCRIPT), run_name="__main__")
    assert exited.value.code == 2 and "--startup-kit: --env prod needs" in capsys.readouterr().err
    assert started == []


def test_every_committed_jobs_record_rebuilds_its_preset():
    """What each committed job.py builds its recipe from is the job's preset, setting for setting (the presets
    check keeps job_spec.json equal to the preset's record; this closes the loop back to the spec)."""
    from jobs.presets import PRESETS

    assert [name for name in PRESETS if recorded_spec(REPO / "jobs" / name) != PRESETS[name]] == []
