"""The federated QC under homomorphic encryption (``qc-job --secure-aggregation he``), without a deployment.

CKKS contexts are made here with TenSEAL's own API, with the parameters of NVFlare's HEBuilder (what provisioning
writes), and once with HEBuilder itself. Checked: encrypt / add / decrypt gives exactly the plaintext sum after
rounding, with a rounding error far below 0.5 up to 10^5 people per site; the server's function adds ciphertexts
with a context that has no secret key (and refuses one that has); three sites, the controller and the sites again
(NVFlare replaced by fakes) give every site the same keep-mask, the plaintext path's; bad input is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel

from data_prep.errors import DataPrepError
from data_prep.genotypes.federated_qc import (
    ENCRYPTED_COUNTS,
    HE_COUNTS_NOTE,
    GenotypeQcController,
    encrypted_counts,
    global_qc,
    site_main,
    to_wire,
)
from data_prep.genotypes.qc import QcThresholds, genotype_counts
from tests.helpers import FakeFlare

ts = pytest.importorskip("tenseal")
secure_qc = pytest.importorskip("data_prep.genotypes.secure_qc")

M = 3  # missing
THRESHOLDS = QcThresholds(min_call_rate=0.9, min_maf=0.05)


def hebuilder_parameters() -> tuple[int, list[int], int]:
    """Degree, coefficient moduli and scale bits of NVFlare's HEBuilder as provisioning uses it (its defaults)."""
    from nvflare.lighter.impl.he import HEBuilder

    builder = HEBuilder()
    return builder.poly_modulus_degree, list(builder.coeff_mod_bit_sizes), builder.scale_bits


@pytest.fixture(scope="module")
def site_context() -> ts.Context:
    """A site's context, as HEBuilder makes one, with TenSEAL's own API: symmetric CKKS, secret key kept."""
    degree, moduli, scale_bits = hebuilder_parameters()
    context = ts.context(
        ts.SCHEME_TYPE.CKKS, poly_modulus_degree=degree, coeff_mod_bit_sizes=moduli,
        encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC,
    )  # fmt: skip
    context.generate_relin_keys()
    context.global_scale = 2**scale_bits
    return context


@pytest.fixture(scope="module")
def server_context(site_context: ts.Context) -> ts.Context:
    """The same context with its secret key dropped, as the server's kit holds it."""
    public = ts.context_from(site_context.serialize(save_secret_key=False))
    assert not public.is_private()
    return public


def copy_of(context: ts.Context) -> ts.Context:
    """What one more site loads from its own kit: an independent copy of the same (private) context."""
    return ts.context_from(context.serialize(save_secret_key=True))


def random_counts(rng: np.random.Generator, people: int, snps: int) -> np.ndarray:
    """(S, 4) counts of ``people``: each SNP's row splits every person among 0 / 1 / 2 copies / missing."""
    return rng.multinomial(people, [0.5, 0.3, 0.15, 0.05], size=snps).astype(np.int64)


# ---- encrypt, add, decrypt ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("people", [50, 1_000, 100_000])
def test_the_decrypted_sum_is_exactly_the_plaintext_sum_after_rounding(
    site_context: ts.Context, server_context: ts.Context, people: int
) -> None:
    rng = np.random.default_rng(people)
    snps = tuple(f"rs{j}" for j in range(2_000))  # 8,000 values: two ciphertexts at 4,096 slots
    sites = {f"site-{i}": random_counts(rng, people + i, len(snps)) for i in range(1, 4)}
    sent = {site: (snps, secure_qc.encrypt_counts(copy_of(site_context), c)) for site, c in sites.items()}
    got_snps, summed = secure_qc.add_encrypted_counts(server_context, sent)
    total, rounding = secure_qc.decrypt_counts("site-1", site_context, summed, len(snps))
    assert got_snps == snps
    np.testing.assert_array_equal(total, sum(sites.values()))
    # Measured about 1.5e-9 at every size here: far below 0.5, and far below the refusal bound.
    assert rounding < 1e-6 < secure_qc.ROUNDING_TOLERANCE < 0.5


def test_hebuilders_own_contexts_add_at_the_server_and_decrypt_at_a_site() -> None:
    from nvflare.lighter.impl.he import HEBuilder

    builder = HEBuilder()
    builder.initialize(None, None)  # makes the context; build() would only write these bytes into the kits
    site = ts.context_from(builder.get_serialized_context(is_client=True))
    server = ts.context_from(builder.get_serialized_context())
    assert site.is_private() and not server.is_private()
    counts = random_counts(np.random.default_rng(0), 70, 10)
    _, summed = secure_qc.add_encrypted_counts(
        server, {"site-1": (("a",) * 10, secure_qc.encrypt_counts(site, counts))}
    )
    np.testing.assert_array_equal(secure_qc.decrypt_counts("site-1", site, summed, 10)[0], counts)


def test_the_server_adds_without_a_secret_key_and_cannot_decrypt(
    site_context: ts.Context, server_context: ts.Context
) -> None:
    snps = ("rs0", "rs1")
    blob = secure_qc.encrypt_counts(site_context, random_counts(np.random.default_rng(1), 60, 2))
    _, summed = secure_qc.add_encrypted_counts(server_context, {"site-1": (snps, blob), "site-2": (snps, blob)})
    with pytest.raises(ValueError):  # TenSEAL: no secret key, no decryption
        ts.ckks_vector_from(server_context, summed).decrypt()


def test_a_server_context_with_a_secret_key_is_refused(site_context: ts.Context) -> None:
    with pytest.raises(DataPrepError, match="holds a secret key, so the server could decrypt the sites' counts"):
        secure_qc.add_encrypted_counts(site_context, {"site-1": (("rs0",), b"")})


def test_the_server_refuses_by_site_another_table_or_a_vector_of_the_wrong_length(
    site_context: ts.Context, server_context: ts.Context
) -> None:
    three = secure_qc.encrypt_counts(site_context, np.ones((3, 4)))
    with pytest.raises(DataPrepError, match="site-2 harmonised against other SNPs than site-1"):
        secure_qc.add_encrypted_counts(server_context, {"site-1": (("a", "b", "c"), three), "site-2": (("a",), three)})
    with pytest.raises(DataPrepError, match=r"site-1 sent 12 encrypted counts, expected 8 \(4 per SNP\)"):
        secure_qc.add_encrypted_counts(server_context, {"site-1": (("a", "b"), three)})
    with pytest.raises(DataPrepError, match="site-3 sent bytes that are not a CKKS vector here"):
        secure_qc.add_encrypted_counts(server_context, {"site-3": (("a",), b"not a ciphertext")})


# ---- rounding and the site's checks ---------------------------------------------------------------------------------


def test_values_too_far_from_an_integer_are_refused_loudly() -> None:
    values = np.array([10.0, 5.0, 3.0, 2.0, 11.0, 4.0, 3.3, 2.0])  # SNP 1 is 0.3 off
    with pytest.raises(DataPrepError) as refused:
        secure_qc.round_counts("site-2", values, 2)
    message = str(refused.value)
    assert "\n" not in message
    assert "site-2: the decrypted sum lies 0.3 from an integer at SNP 1 (allowed: at most 0.001)" in message
    with pytest.raises(DataPrepError, match="lies nan from an integer"):
        secure_qc.round_counts("site-2", np.array([np.nan, 1.0, 1.0, 1.0]), 1)


def test_rounding_keeps_small_errors_and_reports_the_largest() -> None:
    counts, rounding = secure_qc.round_counts("site-1", np.array([9.9999999, 5.0000002, 3.0, 2.0]), 1)
    assert counts.tolist() == [[10, 5, 3, 2]] and rounding == pytest.approx(2e-7, rel=1e-3)


@pytest.mark.parametrize(
    ("values", "snps", "why"),
    [
        (np.array([-1.0, 5.0, 3.0, 2.0]), 1, "negative counts"),
        (np.array([1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 2, "not genotype counts: .*4 at SNP 0, 8 at SNP 1"),
        (np.array([1.0, 1.0, 1.0]), 1, "decrypted 3 counts, expected 4"),
        (np.array([float(secure_qc.MAX_HE_PEOPLE) + 1, 0.0, 0.0, 0.0]), 1, "above 1000000000"),
    ],
)
def test_a_decrypted_sum_that_is_not_counts_is_refused(values: np.ndarray, snps: int, why: str) -> None:
    with pytest.raises(DataPrepError, match=why):
        secure_qc.round_counts("site-1", values, snps)


def test_a_site_beyond_the_exact_range_refuses_to_encrypt() -> None:
    secure_qc.check_he_people("site-1", secure_qc.MAX_HE_PEOPLE)
    with pytest.raises(DataPrepError, match=r"site-1 has 1000000001 people; .*allowed: at most 1000000000"):
        secure_qc.check_he_people("site-1", secure_qc.MAX_HE_PEOPLE + 1)


def test_a_sum_smaller_than_the_sites_own_counts_is_refused() -> None:
    own = np.array([[5, 3, 1, 1]])
    secure_qc.check_sum_covers_site("site-1", own + 7, own)
    with pytest.raises(DataPrepError, match="site-1: the decrypted sum is smaller than this site's own counts"):
        secure_qc.check_sum_covers_site("site-1", np.array([[4, 9, 9, 9]]), own)


def test_clear_counts_sent_to_an_he_server_are_refused_by_site() -> None:
    clear = FLModel(params={"counts": np.ones((2, 4))}, meta={"client_name": "site-4"})
    with pytest.raises(DataPrepError, match="site-4 sent no encrypted counts, but the job uses secure_aggregation"):
        encrypted_counts(clear)


# ---- three sites, the server, the sites again -----------------------------------------------------------------------

SNPS = tuple(f"rs{j}" for j in range(30))


def site_genotypes(seed: int, people: int) -> np.ndarray:
    """People x SNPS with rare SNPs (below the MAF threshold in the pool) and a few badly called ones."""
    rng = np.random.default_rng(seed)
    freqs = np.linspace(0.005, 0.5, len(SNPS))
    genotypes = rng.binomial(2, freqs, size=(people, len(SNPS))).astype(np.int8)
    genotypes[rng.random(genotypes.shape) < np.linspace(0.0, 0.2, len(SNPS))] = M
    return genotypes


def write_site_files(folder: Path, genotypes: np.ndarray) -> None:
    """A harmonised .npz and the consortium's table, as ``harmonise`` writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    samples = np.array([f"{folder.name}-{i}" for i in range(len(genotypes))])
    status = np.array(["same"] * len(SNPS))
    np.savez(folder / "site.npz", genotypes=genotypes, samples=samples, snps=np.array(SNPS), status=status)
    rows = "".join(f"{s},1,{10 * (j + 1)},A,G\n" for j, s in enumerate(SNPS))
    (folder / "table.csv").write_text("snp,chrom,pos,ref,alt\n" + rows)


def run_site(monkeypatch: pytest.MonkeyPatch, folder: Path, flare: FakeFlare, *options: str) -> list[FLModel]:
    """One site_main call for ``flare.site`` on the files in ``folder``; returns what the site sent."""
    monkeypatch.setenv("FEDALG_SITE_GENOTYPES", str(folder / "site.npz"))
    monkeypatch.setenv("FEDALG_SNP_TABLE", str(folder / "table.csv"))
    flare.install(monkeypatch)
    site_main(["--out", str(folder / "filtered.csv"), "--min-site-people", "40", *options])
    return flare.sent


class FakeServerRun:
    """NVFlare around the controller: the sites' answers to the counts request, the run folder, the log."""

    def __init__(self, run_dir: Path, answers: list[FLModel]) -> None:
        self.run_dir, self.answers, self.sent, self.log = run_dir, answers, [], []

    def attach(self, controller: GenotypeQcController) -> GenotypeQcController:
        controller.send_model_and_wait = self.send  # type: ignore[method-assign]
        controller.get_run_dir = lambda: str(self.run_dir)  # type: ignore[method-assign]
        controller.info = lambda msg: self.log.append(msg)  # type: ignore[method-assign]
        controller.warning = lambda msg: self.log.append(msg)  # type: ignore[method-assign]
        controller.abort_signal = Signal()
        controller.fl_ctx = None
        return controller

    def send(self, task_name: str, data: FLModel) -> list[FLModel]:
        self.sent.append(data)
        return self.answers if task_name == "qc_counts" else []


def test_every_site_filters_the_decrypted_sum_to_the_plaintext_paths_keep_mask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, site_context: ts.Context, server_context: ts.Context
) -> None:
    people = {"site-1": 40, "site-2": 55, "site-3": 70}
    genotypes = {site: site_genotypes(i, n) for i, (site, n) in enumerate(people.items())}
    for site, matrix in genotypes.items():
        write_site_files(tmp_path / site, matrix)
    # Every site loads its own copy of the provisioned context; the server the key-less one.
    monkeypatch.setattr(secure_qc, "load_client_context", lambda site, startup: copy_of(site_context))
    monkeypatch.setattr(secure_qc, "load_server_context", lambda fl_ctx: server_context)
    he = ["--secure-aggregation", "he", "--min-call-rate", "0.9", "--min-maf", "0.05"]

    request = FLModel(params={"none": np.zeros(1)}, meta={"step": "qc_counts", "secure_aggregation": "he"})
    answers = []
    for site in people:
        (sent,) = run_site(monkeypatch, tmp_path / site, FakeFlare(site, [request]), *he)
        assert set(sent.params) == {ENCRYPTED_COUNTS}  # ciphertext bytes only, no clear counts
        answers.append(FLModel(params=sent.params, meta={**sent.meta, "client_name": site}))

    server = FakeServerRun(tmp_path / "server", answers)
    (tmp_path / "server").mkdir()
    server.attach(GenotypeQcController(0.9, 0.05, min_site_people=40, secure_aggregation="he")).run()
    assert server.log[0] == HE_COUNTS_NOTE and "only size check" in HE_COUNTS_NOTE
    report = json.loads((tmp_path / "server" / "qc_report.json").read_text())
    assert report == {
        "secure_aggregation": "he",
        "sites": ["site-1", "site-2", "site-3"],
        "thresholds": {"min_call_rate": 0.9, "min_maf": 0.05, "min_site_people": 40},
        "table_snps": len(SNPS),
    }  # who took part and the settings: no figure of the data
    _, message = server.sent
    assert set(message.params) == {"sum_he"} and message.meta["sites"] == ["site-1", "site-2", "site-3"]

    pooled = genotype_counts(np.concatenate(list(genotypes.values())))
    plain_keep, plain_report = global_qc(SNPS, pooled, THRESHOLDS, list(people), 40)
    assert 0 < plain_keep.sum() < len(SNPS)  # the thresholds drop some SNPs, so the masks are a real check
    masks = {}
    for site in people:
        (ack,) = run_site(monkeypatch, tmp_path / site, FakeFlare(site, [message]), *he)
        assert ack.meta == {}  # not even the kept count goes back to the server
        rows = (tmp_path / site / "filtered.csv").read_text().splitlines()[1:]
        masks[site] = [row.split(",")[0] for row in rows]
        site_report = json.loads((tmp_path / site / "qc_report.json").read_text())
        assert site_report["kept"] == masks[site] and site_report["people"] == sum(people.values())
        assert site_report["global_qc"] == plain_report["global_qc"] and site_report["he_rounding_error"] < 1e-6
    assert masks["site-1"] == masks["site-2"] == masks["site-3"] == plain_report["kept"]


def test_without_a_provisioned_context_the_site_fails_in_one_line_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nvflare.fuel.sec.security_content_service import SecurityContentService

    write_site_files(tmp_path / "site-1", site_genotypes(0, 40))
    monkeypatch.setattr(SecurityContentService, "content_folder", None)  # no NVFlare job process: find the kit
    monkeypatch.chdir(tmp_path)
    request = FLModel(params={"none": np.zeros(1)}, meta={"step": "qc_counts"})
    flare = FakeFlare("site-1", [request])
    with pytest.raises(DataPrepError) as refused:
        run_site(monkeypatch, tmp_path / "site-1", flare, "--secure-aggregation", "he")
    message = str(refused.value)
    assert "\n" not in message
    assert f"site-1: secure_aggregation 'he' needs the site's TenSEAL context {tmp_path}/startup/client_context." in (
        message
    )
    assert "HEBuilder" in message and "nothing sent" in message
    assert flare.sent == [] and len(flare.inbox) == 1  # refused before answering the server at all


def test_an_unsigned_context_is_refused_by_nvflares_signature_check(tmp_path: Path, site_context: ts.Context) -> None:
    (tmp_path / "startup").mkdir()
    (tmp_path / "startup" / "client_context.tenseal").write_bytes(site_context.serialize(save_secret_key=True))
    with pytest.raises(DataPrepError, match=r"client_context.tenseal failed NVFlare's signature check \(notSigned"):
        secure_qc.load_client_context("site-1", tmp_path / "startup")


# ---- the exported job -----------------------------------------------------------------------------------------------


def test_he_travels_to_both_sides_of_the_exported_job_with_the_thresholds(tmp_path: Path) -> None:
    from data_prep.genotypes.cli import main

    options = ["--num-sites", "3", "--min-maf", "0.05", "--min-site-people", "40", "--secure-aggregation", "he"]
    assert main(["qc-job", "--output-dir", str(tmp_path), *options]) == 0
    config = tmp_path / "genotype_qc" / "app" / "config"
    server = json.loads((config / "config_fed_server.json").read_text())["workflows"][0]["args"]
    assert server == {"min_maf": 0.05, "min_site_people": 40, "secure_aggregation": "he"}
    client = json.loads((config / "config_fed_client.json").read_text())["executors"][0]["executor"]["args"]
    assert client["task_script_args"] == (
        "--min-site-people 40 --secure-aggregation he --min-call-rate 0.95 --min-maf 0.05"
    )


def test_an_unknown_secure_aggregation_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from data_prep.genotypes.cli import main

    with pytest.raises(SystemExit):
        main(["qc-job", "--output-dir", "/nonexistent", "--secure-aggregation", "rsa"])
    assert "invalid choice: 'rsa' (choose from 'none', 'he', 'secagg')" in capsys.readouterr().err
    with pytest.raises(DataPrepError, match="secure_aggregation must be one of none, he, secagg, got 'rsa'"):
        GenotypeQcController(secure_aggregation="rsa")


def test_encrypted_counts_travel_as_a_numpy_byte_array(site_context: ts.Context) -> None:
    blob = secure_qc.encrypt_counts(site_context, np.ones((2, 4)))
    wire = to_wire(blob)
    assert wire.dtype == np.uint8 and wire.tobytes() == blob


def test_an_he_job_of_two_sites_is_refused_at_export_and_at_the_server(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    site_context: ts.Context,
    server_context: ts.Context,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every site decrypts the sum; with two sites the sum less one's own counts is the other's counts."""
    from data_prep.genotypes.cli import main

    assert main(["qc-job", "--output-dir", str(tmp_path), "--num-sites", "2", "--secure-aggregation", "he"]) == 2
    error = capsys.readouterr().err
    assert "secure_aggregation 'he' with 2 sites (--num-sites)" in error and "allowed: 3 sites or more" in error
    assert not (tmp_path / "genotype_qc").exists()
    blob = to_wire(secure_qc.encrypt_counts(site_context, np.ones((1, 4))))
    answers = [FLModel(params={ENCRYPTED_COUNTS: blob}, meta={"client_name": s, "snps": ["rs0"]}) for s in ("a", "b")]
    monkeypatch.setattr(secure_qc, "load_server_context", lambda fl_ctx: server_context)
    server = FakeServerRun(tmp_path, answers)
    with pytest.raises(DataPrepError, match=r"with 2 sites \(sites that answered\)"):
        server.attach(GenotypeQcController(secure_aggregation="he")).run()
    assert len(server.sent) == 1 and not (tmp_path / "qc_report.json").exists()  # no sum computed or sent
