"""A site's noisy QC release (lightning_modules/privacy/qc_release.py), played as the server or another site would
attack it: the spend is in the site's ledger before anything leaves, its epsilon is a maintained accountant's, a
release beyond the budget (or noise without one) sends nothing, and the noise can be neither replayed nor removed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from nvflare.app_common.abstract.fl_model import FLModel

from data_prep.errors import DataPrepError
from data_prep.genotypes.federated_qc import site_main as plain_site_main
from data_prep.genotypes.qc import genotype_counts
from data_prep.genotypes.qc_noise import QcNoise, discrete_gaussian, l2_sensitivity
from lightning_modules.privacy.accountant import DEFAULT_ORDERS, Segment, epsilon
from lightning_modules.privacy.ledger import LEDGER_NAME, ledger_from_state
from lightning_modules.privacy.qc_release import QcBudgetExhausted, release_counts, site_main
from lightning_modules.state_store import ClientStateStore
from tests.helpers import FakeFlare

SNPS = tuple(f"rs{j}" for j in range(200))
RUN = "qc-run-1"


def cohort(people: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 3, size=(people, len(SNPS))).astype(np.int8)


def store(tmp_path: Path, site: str = "site-1") -> ClientStateStore:
    return ClientStateStore(tmp_path / "state", site, per_run=True)


def ledger_of(tmp_path: Path, site: str = "site-1"):
    stored = store(tmp_path, site)
    stored.use_run(RUN)
    loaded = stored.load(LEDGER_NAME)
    return None if loaded is None else ledger_from_state(loaded.state)


# ---- accounting -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("z", [0.3, 0.6, 1.0, 3.0])
def test_one_release_is_one_gaussian_step_whose_epsilon_a_maintained_accountant_confirms(z: float) -> None:
    import dp_accounting

    ours = epsilon([Segment(1.0, z, 1)], 1e-5)
    accountant = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(z))
    assert math.isclose(ours, accountant.get_epsilon(1e-5), rel_tol=1e-6)
    # the RDP curve is the Gaussian's alpha / (2 z^2), which the discrete Gaussian stays under (qc_noise docstring)
    from lightning_modules.privacy.accountant import rdp_curve

    curve = rdp_curve([Segment(1.0, z, 1)])
    assert all(math.isclose(r, a / (2 * z * z), rel_tol=1e-9) for r, a in zip(curve, DEFAULT_ORDERS, strict=True))
    pld = dp_accounting.pld.PLDAccountant().compose(dp_accounting.GaussianDpEvent(z)).get_epsilon(1e-5)
    assert pld <= ours  # RDP is the looser, safe side


def test_the_ledger_holds_the_release_before_the_counts_are_returned(tmp_path: Path) -> None:
    counts = genotype_counts(cohort(300))
    noisy, spent = release_counts("site-1", counts, QcNoise(None, 4.0), store(tmp_path), RUN)
    ledger = ledger_of(tmp_path)
    assert ledger.segments == (Segment(1.0, spent["noise_multiplier"], 1),) and ledger.delta == 1e-5
    # calibrated to spend the budget: within noise_for_budget's 0.1 % on z
    assert 4.0 * 0.99 < spent["epsilon"] <= 4.0 and math.isclose(ledger.epsilon(), spent["epsilon"])
    assert math.isclose(spent["sigma"], spent["noise_multiplier"] * math.sqrt(len(SNPS)), rel_tol=1e-12)
    assert noisy.shape == counts.shape and noisy.dtype == np.int64


def test_a_release_beyond_the_budget_is_refused_and_nothing_is_spent(tmp_path: Path) -> None:
    with pytest.raises(QcBudgetExhausted, match=r"would take epsilon from 0 to .* > dp_target_epsilon 1 ") as refused:
        release_counts("site-1", genotype_counts(cohort(100)), QcNoise(0.5, 1.0), store(tmp_path), RUN)
    assert "\n" not in str(refused.value) and "nothing sent" in str(refused.value)
    assert ledger_of(tmp_path) is None


def test_a_second_release_in_the_same_run_spends_only_what_the_ledger_has_left(tmp_path: Path) -> None:
    counts = genotype_counts(cohort(100))
    _, first = release_counts("site-1", counts, QcNoise(None, 2.0), store(tmp_path), RUN)
    with pytest.raises(QcBudgetExhausted, match=r"would take epsilon from 1\.99"):
        release_counts("site-1", counts, QcNoise(first["noise_multiplier"], 2.0), store(tmp_path), RUN)
    _, second = release_counts("site-1", counts, QcNoise(None, 2.0), store(tmp_path), RUN)  # calibrated: the rest
    assert second["noise_multiplier"] > 10 * first["noise_multiplier"]
    ledger = ledger_of(tmp_path)
    assert len(ledger.segments) == 2 and first["epsilon"] < ledger.epsilon() <= 2.0


# ---- the attacker ---------------------------------------------------------------------------------------------------


def test_the_noise_is_secret_fresh_and_of_the_stated_scale(tmp_path: Path) -> None:
    """The server holds the job (its seed, every setting) and one release; replaying the sampler with the job's seed
    or any small seed does not give the noise back, two releases of the same counts differ, and the noise's spread
    is the sigma the site states."""
    counts = genotype_counts(cohort(333))
    noise = QcNoise(None, 8.0)
    first, spent = release_counts("site-1", counts, noise, store(tmp_path, "site-1"), RUN)
    second, _ = release_counts("site-2", counts, noise, store(tmp_path, "site-2"), RUN)
    drawn = first - counts
    assert not np.array_equal(first, second)
    assert not np.array_equal(first, counts) and (np.abs(drawn) > 0).mean() > 0.9
    for seed in [*range(1000), 20260501]:
        replay = discrete_gaussian(counts.shape, spent["sigma"], np.random.default_rng(seed))
        assert (replay == drawn).mean() < 0.2  # chance agreement only; subtracting leaves noise of the same size
        assert np.abs(first - replay - counts).std() > 0.5 * spent["sigma"]
    sd = float(np.concatenate([drawn.ravel(), (second - counts).ravel()]).std())
    assert abs(sd / spent["sigma"] - 1) < 5 / math.sqrt(2 * 2 * drawn.size)


# ---- the site -------------------------------------------------------------------------------------------------------


class QcInbox(FakeFlare):
    def __init__(self, site: str) -> None:
        super().__init__(
            site,
            [
                FLModel(params={"none": np.zeros(1)}, meta={"step": "qc_counts"}),
                FLModel(params={"keep": np.ones(len(SNPS), np.int8)}, meta={"step": "qc_filter", "snps": list(SNPS)}),
            ],
        )

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import nvflare.client as flare

        super().install(monkeypatch)
        monkeypatch.setattr(flare, "get_job_id", lambda: RUN)


def site_files(tmp_path: Path, genotypes: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> Path:
    samples = np.array([f"p{i}" for i in range(len(genotypes))])
    status = np.array(["same"] * len(SNPS))
    np.savez(tmp_path / "site.npz", genotypes=genotypes, samples=samples, snps=np.array(SNPS), status=status)
    table = tmp_path / "table.csv"
    table.write_text("snp,chrom,pos,ref,alt\n" + "".join(f"{s},1,{10 * (j + 1)},A,G\n" for j, s in enumerate(SNPS)))
    monkeypatch.setenv("FEDALG_SITE_GENOTYPES", str(tmp_path / "site.npz"))
    monkeypatch.setenv("FEDALG_SNP_TABLE", str(table))
    monkeypatch.setenv("FLALGO_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "filtered.csv"


def test_a_noisy_site_sends_noisy_counts_after_writing_its_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    genotypes = cohort(120)
    out = site_files(tmp_path, genotypes, monkeypatch)
    flare = QcInbox("site-1")
    flare.install(monkeypatch)
    site_main(["--out", str(out), "--dp-target-epsilon", "8"])
    sent = np.asarray(flare.sent[0].params["counts"])
    assert not np.array_equal(sent, genotype_counts(genotypes)) and sent.shape == (len(SNPS), 4)
    ledger = ledger_of(tmp_path)
    assert ledger.steps == 1 and ledger.epsilon() <= 8.0
    assert "discrete Gaussian noise sigma" in capsys.readouterr().out
    assert out.exists()


@pytest.mark.parametrize(
    ("options", "why"),
    [
        (["--dp-noise-multiplier", "2"], "without a privacy budget"),
        (["--dp-noise-multiplier", "0.2", "--dp-target-epsilon", "1"], "privacy budget: releasing"),
    ],
)
def test_a_site_refuses_noise_without_or_beyond_its_budget_and_sends_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: list[str], why: str
) -> None:
    out = site_files(tmp_path, cohort(120), monkeypatch)
    flare = QcInbox("site-1")
    flare.install(monkeypatch)
    with pytest.raises(DataPrepError, match=why) as refused:
        site_main(["--out", str(out), *options])
    assert str(refused.value).startswith("federated QC: site-1") or str(refused.value).startswith("site-1: ")
    assert flare.sent == [] and not out.exists() and ledger_of(tmp_path) is None


def test_the_plain_qc_script_refuses_noise_it_cannot_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = site_files(tmp_path, cohort(120), monkeypatch)
    flare = QcInbox("site-1")
    flare.install(monkeypatch)
    with pytest.raises(DataPrepError, match="no privacy ledger to account it in"):
        plain_site_main(["--out", str(out), "--dp-target-epsilon", "8"])
    assert flare.sent == []


# ---- the exported job -----------------------------------------------------------------------------------------------


def test_the_noisy_job_ships_the_accounting_script_with_the_settings(tmp_path: Path) -> None:
    from data_prep.genotypes.cli import main

    assert main(["qc-job", "--output-dir", str(tmp_path), "--dp-target-epsilon", "4", "--dp-delta", "1e-6"]) == 0
    config = tmp_path / "genotype_qc" / "app" / "config"
    client = json.loads((config / "config_fed_client.json").read_text())
    server = json.loads((config / "config_fed_server.json").read_text())
    text = json.dumps(client)
    assert "qc_noise_site.py" in text and "--dp-target-epsilon 4.0 --dp-delta 1e-06" in text
    assert (tmp_path / "genotype_qc" / "app" / "custom" / "qc_noise_site.py").exists()
    args = server["workflows"][0]["args"]
    assert args["dp_target_epsilon"] == 4.0 and args["dp_delta"] == 1e-6


def test_noise_without_a_budget_stops_the_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from data_prep.genotypes.cli import main

    assert main(["qc-job", "--output-dir", str(tmp_path), "--dp-noise-multiplier", "1"]) == 2
    assert "without a privacy budget" in capsys.readouterr().err
    assert not (tmp_path / "genotype_qc").exists()


def test_sigma_is_the_noise_multiplier_times_the_add_remove_sensitivity() -> None:
    assert math.isclose(l2_sensitivity(len(SNPS)), math.sqrt(200), abs_tol=1e-12)


def test_a_site_without_opacus_refuses_in_one_line_and_spends_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_modules.privacy import accountant

    def missing():
        raise accountant.AccountantUnavailable("DP-SGD needs Opacus, which is not installed: pip install ...")

    monkeypatch.setattr(accountant, "_rdp_analysis", missing)
    with pytest.raises(DataPrepError, match="site-1: noisy counts are accounted by Opacus") as refused:
        release_counts("site-1", genotype_counts(cohort(50)), QcNoise(2.0, 8.0), store(tmp_path), RUN)
    assert "nothing sent" in str(refused.value) and ledger_of(tmp_path) is None
