"""The PSI job's egress gate (data_prep/genotypes/psi.py, docs/privacy.md's PSI row): a site's PSI results carry
only what NVFlare's DH-PSI protocol sends (its item count, the setup message, its blinded items, the other site's
items re-blinded, the intersection's size), checked as an attacker would break it: a tampered task handler that
adds a key to its result's data is refused and one that adds meta is stripped, named in the site's log. The two-site
protocol runs in process through NVFlare's own ``PSIExecutor`` and ``DhPSITaskHandler``, stage by stage as
``DhPSIWorkFlow`` asks for them, each result through the gate the exported job configures; the slow test runs the
exported pair job in ``nvflare simulator`` with a curious server's recorder (tests/e2e/egress_recorder.py)."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest
from nvflare.apis.dxo import from_shareable
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import PSIConst

from aggregators.contracts.egress import TRANSPORT_HEADERS
from aggregators.contracts.egress_gate import EgressGate, EgressRefused
from data_prep.genotypes.psi import export_psi_jobs, person_items
from tests.data_prep.test_genotypes_psi import CHROMS, N_PEOPLE, SETTINGS, SNPS, simulate, two_sites, write_pair_sites

GATE = "aggregators.contracts.egress_gate.EgressGate"
#: What NVFlare 2.9's DH-PSI sends from a site, by stage (DhPSITaskHandler): each result a ``PSI`` DXO whose data is
#: the handler's Shareable (so its empty ``__headers__`` too) and whose meta is empty.
STAGE_KEYS = {
    "prepare": {PSIConst.ITEMS_SIZE},
    "setup": {PSIConst.SETUP_MSG},
    "request": {PSIConst.REQUEST_MSG},
    "response": {PSIConst.RESPONSE_MSG},
    "intersect": {PSIConst.ITEMS_SIZE},
}


class Items:
    """The site's local PSI component as NVFlare's handler sees it: its items, and the intersection it is given."""

    def __init__(self, items: list[str]) -> None:
        self.items, self.saved = items, None

    def load_items(self) -> list[str]:
        return list(self.items)

    def save(self, intersection: list[str]) -> None:
        self.saved = sorted(intersection)


def site_gates(job: Path, site: str) -> dict[str, EgressGate]:
    """The gate last on each result chain of ``site``'s app, built from the job config as NVFlare would build it."""
    config = json.loads((job / f"app_{site}" / "config" / "config_fed_client.json").read_text())
    gates = {}
    for chain in config.get("task_result_filters", []):
        last = chain["filters"][-1]
        assert last["path"] == GATE, f"{site}: a result chain does not end with the egress gate: {chain}"
        gates.update({task: EgressGate(**last["args"]) for task in chain["tasks"]})
    return gates


def context(site: str) -> FLContext:
    ctx = FLContext()
    ctx.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)
    return ctx


class Site:
    """One site of the pair: NVFlare's PSIExecutor over a DhPSITaskHandler (or ``handler``), then the job's gate."""

    def __init__(self, name: str, items: list[str], gates: dict[str, EgressGate], handler=None, executor=None) -> None:
        from nvflare.app_common.psi.psi_executor import PSIExecutor
        from nvflare.app_opt.psi.dh_psi.dh_psi_task_handler import DhPSITaskHandler

        self.name, self.local = name, Items(items)
        self.handler = handler or DhPSITaskHandler(local_psi_id="local_psi")
        self.handler.local_psi_handler = self.local
        self.executor = executor or PSIExecutor(psi_algo_id="dh_psi")
        self.executor.task_handler = self.handler
        self.gate = gates.get(PSIConst.TASK)
        self.sent: list[tuple[str, set[str], dict]] = []

    def run(self, stage: str, task_data: dict) -> dict:
        """The stage's task through the executor and the gate; what leaves the site (the DXO's data)."""
        task = Shareable()
        task[PSIConst.TASK_KEY] = {
            "prepare": PSIConst.TASK_PREPARE,
            "setup": PSIConst.TASK_SETUP,
            "request": PSIConst.TASK_REQUEST,
            "response": PSIConst.TASK_RESPONSE,
            "intersect": PSIConst.TASK_INTERSECT,
        }[stage]
        task.update(task_data)
        ctx = context(self.name)
        result = self.executor.execute(PSIConst.TASK, task, ctx, Signal())
        if self.gate is not None:  # a job without a gate sends the result as the executor made it
            result = self.gate.process(result, ctx)
        dxo = from_shareable(result)
        self.sent.append((stage, set(dxo.data) - {"__headers__"}, dict(dxo.meta)))
        return dxo.data


def two_site_psi(small: Site, large: Site) -> None:
    """DhPSIWorkFlow's messages for two sites (``small`` holds fewer items): the forward pass (``small`` sets up,
    ``large`` learns the intersection), then the backward pass (``large`` sets up on it, ``small`` learns it)."""
    c = PSIConst
    sizes = {s.name: s.run("prepare", {c.BLOOM_FILTER_FPR: 1e-11})[c.ITEMS_SIZE] for s in (small, large)}
    assert sizes[small.name] <= sizes[large.name]
    setup = small.run("setup", {c.ITEMS_SIZE: sizes[large.name]})[c.SETUP_MSG]
    request = large.run("request", {c.SETUP_MSG: setup})[c.REQUEST_MSG]
    response = small.run("response", {c.REQUEST_MSG: request})[c.RESPONSE_MSG]
    large.run("intersect", {c.RESPONSE_MSG: response})
    setups = large.run("setup", {c.ITEMS_SIZE_SET: {sizes[small.name]}})[c.SETUP_MSG]
    request = small.run("request", {c.SETUP_MSG: setups[str(sizes[small.name])]})[c.REQUEST_MSG]
    responses = large.run("response", {c.REQUEST_MSG_SET: {small.name: request}})[c.RESPONSE_MSG]
    small.run("intersect", {c.RESPONSE_MSG: responses[small.name]})


def pair_items() -> tuple[list[str], list[str]]:
    """The two sites' fingerprints (site-2's person 7 is site-1's person 3), site-1 with three people fewer."""
    site_1, site_2 = two_sites(discordant=2)
    return (person_items(site_1[:-3], SNPS, CHROMS, *SETTINGS)[2], person_items(site_2, SNPS, CHROMS, *SETTINGS)[2])


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    (exported,) = export_psi_jobs(tmp_path_factory.mktemp("psi_egress"), ["site-1", "site-2"])
    return exported


def test_every_site_of_the_pair_job_ends_its_psi_results_with_the_gate(job: Path) -> None:
    for site in ("site-1", "site-2"):
        gates = site_gates(job, site)
        assert set(gates) == {PSIConst.TASK}
        release = gates[PSIConst.TASK].release
        assert release.data_kinds == ("PSI",) and release.meta == () and release.metrics == ()
        assert set(release.data) == set().union(*STAGE_KEYS.values()) | {"__headers__"}
        assert release.headers == TRANSPORT_HEADERS


def test_a_normal_psi_passes_the_gate_with_nothing_stripped(job: Path, caplog) -> None:
    pytest.importorskip("private_set_intersection")
    items_1, items_2 = pair_items()
    small = Site("site-1", items_1, site_gates(job, "site-1"))
    large = Site("site-2", items_2, site_gates(job, "site-2"))
    with caplog.at_level(logging.WARNING):
        two_site_psi(small, large)
    assert "egress gate" not in caplog.text
    # Both learn the shared fingerprints (a Bloom filter false positive may add one: not asserted exactly).
    shared = set(items_1) & set(items_2)
    assert len(shared) >= SETTINGS[2] and shared <= set(small.local.saved) and shared <= set(large.local.saved)
    for site in (small, large):
        # each stage once (the forward pass asks one site for setup and response, the backward pass the other)
        assert sorted((stage, sorted(keys)) for stage, keys, _ in site.sent) == sorted(
            (stage, sorted(keys)) for stage, keys in STAGE_KEYS.items()
        )
        assert all(meta == {} for _, _, meta in site.sent)


PREPARE = {PSIConst.BLOOM_FILTER_FPR: 1e-11}


def test_a_tampered_handler_adding_data_to_its_psi_result_is_refused(job: Path, caplog) -> None:
    """The attacker's site code puts its people's IDs beside its item count: nothing of the result is sent."""
    from nvflare.app_opt.psi.dh_psi.dh_psi_task_handler import DhPSITaskHandler

    class Tampered(DhPSITaskHandler):
        def execute_task(self, task_name, shareable, fl_ctx, abort_signal):
            result = super().execute_task(task_name, shareable, fl_ctx, abort_signal)
            result["people"] = ["a0", "a1"]
            return result

    site = Site("site-1", pair_items()[0], site_gates(job, "site-1"), Tampered(local_psi_id="local_psi"))
    with caplog.at_level(logging.ERROR), pytest.raises(EgressRefused, match=r"undeclared data keys \['people'\]"):
        site.run("prepare", PREPARE)
    assert "site-1: egress gate refused the PSI result, nothing of it sent: undeclared data keys ['people']" in (
        caplog.text
    )


def test_a_tampered_executor_adding_meta_to_its_psi_result_is_stripped_and_named(job: Path, caplog) -> None:
    """A PSIExecutor that labels its result with the site's head count and cohort: both stripped, named."""
    from nvflare.app_common.psi.psi_executor import PSIExecutor

    class Tampered(PSIExecutor):
        def execute(self, task_name, shareable, fl_ctx, abort_signal):
            dxo = from_shareable(super().execute(task_name, shareable, fl_ctx, abort_signal))
            dxo.meta.update({"site.people": N_PEOPLE - 3, "cohort": "a"})
            return dxo.to_shareable()

    items = pair_items()[0]
    site = Site("site-1", items, site_gates(job, "site-1"), executor=Tampered(psi_algo_id="dh_psi"))
    with caplog.at_level(logging.WARNING):
        data = site.run("prepare", PREPARE)
    assert data[PSIConst.ITEMS_SIZE] == len(items)
    assert site.sent[-1][2] == {}  # the DXO that leaves has no meta
    assert re.search(r"site-1: egress gate stripped from the PSI result what the job does not declare: "
                     r"meta \['cohort', 'site.people'\]", caplog.text)  # fmt: skip


def test_a_result_of_another_dxo_kind_is_refused(job: Path) -> None:
    from nvflare.apis.dxo import DXO

    gate = site_gates(job, "site-2")[PSIConst.TASK]
    weights = DXO(data_kind="WEIGHTS", data={PSIConst.ITEMS_SIZE: 3}).to_shareable()
    with pytest.raises(EgressRefused, match=r"DXO kind 'WEIGHTS' is not declared \(declared: \['PSI'\]\)"):
        gate.process(weights, context("site-2"))


@pytest.mark.slow
def test_a_curious_servers_recorder_finds_only_the_declared_psi_messages(tmp_path: Path) -> None:
    """The pair job in ``nvflare simulator``, the recorder first among the server's result filters: every result
    that arrives is a PSI DXO with declared data keys only, no meta, NVFlare's headers only; no gate line."""
    pytest.importorskip("private_set_intersection")
    pytest.importorskip("cyvcf2")
    sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
    try:
        from egress_recorder import beyond_declared, install, read
    finally:
        sys.path.pop(0)

    env = write_pair_sites(tmp_path)
    (job,) = export_psi_jobs(tmp_path / "jobs", ["site-1", "site-2"])
    record = tmp_path / "record.jsonl"
    (job / "app_server" / "custom").mkdir(exist_ok=True)  # the server app ships no code of its own
    (job / "app").symlink_to(job / "app_server")  # the recorder's install reads the job's one app; here, the server's
    try:
        install(job, [PSIConst.TASK], record)
    finally:
        (job / "app").unlink()
    simulate(job, tmp_path / "ws", env)
    shared = {s: json.loads((tmp_path / f"{s}_shared.json").read_text())["shared"] for s in ("site-1", "site-2")}
    assert shared == {"site-1": {"site-2": ["a3"]}, "site-2": {"site-1": ["b7"]}}
    records = read(record)
    # Two sites: each answers prepare, setup, request, response and intersect once (forward and backward pass).
    assert sorted((r["site"], tuple(r["data"])) for r in records) == sorted(
        (site, tuple(sorted({"__headers__"} | keys))) for site in ("site-1", "site-2") for keys in STAGE_KEYS.values()
    )
    assert all(r["data_kind"] == "PSI" and r["meta"] == {} and r["top_level"] == [] for r in records)
    for site in ("site-1", "site-2"):
        (job / "app").symlink_to(job / f"app_{site}")
        try:
            assert beyond_declared([r for r in records if r["site"] == site], job, TRANSPORT_HEADERS) == []
        finally:
            (job / "app").unlink()
    logs = "".join(log.read_text() for log in (tmp_path / "ws").glob("site-*/**/log.txt"))
    assert "egress gate" not in logs
