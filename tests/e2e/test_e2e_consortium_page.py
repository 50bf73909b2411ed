"""docs/tutorials/consortium.md, replayed: the page's blocks marked ``<!-- replay -->`` (the simulator path: each site's
file in its own format, harmonise, federated QC, harmonise against the filtered table, the DP-SGD + FedPer + keep
best + local-only job built with ``--snp-table``, the simulator run, the server's and a site's report) run as written,
in order, by bash, with the page's settings block (``<!-- replay: settings -->``) replaced by a small scale: 3 sites
(``vcf.gz``, ``bed``, ``pgen``), 300 SNPs, 40 people per population, 1 round. The deployment blocks
(``<!-- deployment -->``) are only checked to be there and to use the same job and files.

Then both sides of a DP site's own scores: each site's ``site_scores.jsonl`` holds its gain over training
alone and the site's report prints it; the server's records, its run folder and its report hold none of it.
106 s and 169 s (two runs) on the 2-core development machine while a long benchmark ran beside it (load average
about 9; most of it the two simulator runs and the builder's import check in a subprocess). A simulator start-up
failure (tests/e2e/simulator_run.py) reruns the whole page in a fresh folder, once.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

from controllers import report
from tests.e2e.simulator_run import run_simulator_command

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "tutorials" / "consortium.md"
BLOCK = re.compile(r"<!-- (replay|replay: settings|deployment) -->\n```bash\n(.*?)\n```", re.S)
SMALL = {
    "SITES": "3",
    "SNPS": "300",
    "PEOPLE": "40",
    "ROUNDS": "1",
    "FORMATS": "vcf.gz,bed,pgen",
    "FILES": '"site-1.vcf.gz site-2.bed site-3.pgen"',
}
GAIN = "kept_minus_local_test_accuracy"


def page_blocks(text: str) -> dict[str, list[str]]:
    """The page's marked bash blocks by marker, in page order."""
    blocks: dict[str, list[str]] = {"replay": [], "replay: settings": [], "deployment": []}
    for marker, body in BLOCK.findall(text):
        blocks[marker].append(body)
    return blocks


def assigned(block: str) -> set[str]:
    """The shell variables a settings block assigns."""
    return set(re.findall(r"(?:^|\s)([A-Z]+)=", block, re.M))


def test_the_page_has_its_marked_blocks_and_one_settings_block() -> None:
    blocks = page_blocks(PAGE.read_text())
    (settings,) = blocks["replay: settings"]
    assert assigned(settings) == {"C", "J", "W", *SMALL}
    assert len(blocks["replay"]) == 7 and len(blocks["deployment"]) == 2
    replayed = "\n".join(blocks["replay"])
    for command in ("simulate-sites", "harmonise", "qc-job", "nvflare simulator", "jobs.build", "controllers.report"):
        assert command in replayed, command
    deployed = "\n".join(blocks["deployment"])
    assert "--secure-aggregation he" in deployed and deployed.count("jobs.provision.loopback") == 2
    assert "$J/consortium_dp" in deployed and '"$C/{site}.qc.npz"' in deployed


@pytest.mark.slow
def test_the_pages_simulator_commands_run_as_written_and_each_site_reads_its_own_gain(tmp_path) -> None:
    blocks = page_blocks(PAGE.read_text())
    root = tmp_path / "page"  # everything the page writes: a simulator start-up failure reruns it all, afresh
    settings = {"C": str(root / "consortium"), "J": str(root / "jobs"), "W": str(root / "ws"), **SMALL}
    script = ["set -euo pipefail", *(f"{name}={value}" for name, value in settings.items()), *blocks["replay"]]
    env = {**os.environ, "FEDALG_CACHE_DIR": str(tmp_path / "cache")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    for name in ("FEDALG_SITE_GENOTYPES", "FEDALG_SNP_TABLE", "FEDALG_SITE_LABELS"):
        env.pop(name, None)
    done = run_simulator_command(["bash", "-c", "\n".join(script)], root, timeout=900, cwd=REPO, env=env)
    (tmp_path / "page.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    files, ws = root / "consortium", root / "ws"
    cohort = json.loads((files / "cohort.json").read_text())
    assert cohort["files"] == {"site-1": "site-1.vcf.gz", "site-2": "site-2.bed", "site-3": "site-3.pgen"}
    # The model's size came from the QC's table (fewer SNPs than the consortium's), not from a typed number.
    kept = len((ws / "qc" / "site-1" / "local" / "fedalg_qc_snp_table.csv").read_text().splitlines()) - 1
    spec = json.loads((root / "jobs" / "consortium_dp" / "job_spec.json").read_text())
    model_args = spec["settings"]["model_args"]
    assert 0 < kept < 300 and model_args["n_snps"] == kept and model_args["num_classes"] == 4

    records = report.finished_records(ws / "dp", done.stdout[-3000:])
    rounds = [r for r in records if r["stage"] == "round"]
    assert [r["status"] for r in rounds] == ["aggregated"]
    assert all(0 < p["epsilon"] <= 8.0 for p in rounds[0]["privacy"].values())
    # The server's side holds none of the sites' scores: not in its records, not anywhere in its run folder.
    assert not any(r.get("site_eval") for r in records)
    server_files = [p for p in (ws / "dp" / "server").rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")]
    assert server_files and not [p for p in server_files if GAIN in p.read_text(errors="ignore")]
    # Each site's own file holds its gain; its report (the page's last command) prints it.
    for site in ("site-1", "site-2", "site-3"):
        (path,) = (ws / "dp" / site / "client_state").rglob("site_scores.jsonl")
        (line,) = [json.loads(text) for text in path.read_text().splitlines()]
        assert line["site"] == site and math.isfinite(line["scores"][GAIN]) and GAIN + "_se" in line["scores"]
    assert "site-1's own scores, kept at the site" in done.stdout and "does this site gain from joining" in done.stdout
    assert "epsilon per site" in done.stdout and "does each site gain from joining" not in done.stdout
