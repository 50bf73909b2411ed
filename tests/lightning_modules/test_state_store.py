"""Tests for ``lightning_modules.state_store``: round trips, restarts, atomic writes and every rejection path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_modules import state_store
from lightning_modules.state_store import (
    FORMAT_VERSION,
    ClientStateStore,
    StateStoreError,
    StoredState,
    default_state_root,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
# Error messages end with "<file>.state: <problem>". Matching from there keeps a word in tmp_path (which contains the
# test's name) from satisfying a pattern on its own.
PROBLEM = r"\.state: "


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Compare raw bytes so NaN payloads and -0.0 count too, which torch.equal would not.
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _sample_state() -> dict[str, object]:
    torch.manual_seed(0)
    return {
        "c_i.weight": torch.randn(4, 3),
        "c_i.bias": torch.tensor([0.0, -0.0, float("nan"), float("inf")]),
        "h.double": torch.randn(5, dtype=torch.float64),
        "steps": torch.tensor(7, dtype=torch.int64),
        "lr_sum": 0.25,
        "note": "scaffold option II",
        "history": [torch.arange(3, dtype=torch.float32), {"inner": torch.ones(2)}],
    }


@pytest.fixture
def store(tmp_path: Path) -> ClientStateStore:
    return ClientStateStore(tmp_path / "state", "site-1")


def test_round_trip_is_bit_exact_with_metadata(store: ClientStateStore) -> None:
    original = _sample_state()

    path = store.save("scaffold", original, round_num=3)
    loaded = store.load("scaffold")

    assert path == store.path("scaffold")
    assert path.is_file()
    assert isinstance(loaded, StoredState)
    assert (loaded.round_num, loaded.site_name, loaded.algorithm, loaded.version) == (
        3,
        "site-1",
        "scaffold",
        FORMAT_VERSION,
    )
    assert loaded.path == path
    assert set(loaded.state) == set(original)
    for key in ("c_i.weight", "c_i.bias", "h.double", "steps"):
        assert _bits_equal(loaded.state[key], original[key]), key
    assert loaded.state["lr_sum"] == 0.25
    assert loaded.state["note"] == "scaffold option II"
    assert _bits_equal(loaded.state["history"][0], original["history"][0])
    assert _bits_equal(loaded.state["history"][1]["inner"], torch.ones(2))


def test_saved_tensors_are_detached_contiguous_and_compact(store: ClientStateStore, tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.randn(3, 5))
    transposed = torch.randn(5, 3).t()
    big = torch.randn(1_000_000)

    store.save("feddyn", {"p": param * 2, "t": transposed, "view": big[:4]}, round_num=1)
    loaded = store.load("feddyn").state

    assert not loaded["p"].requires_grad
    assert loaded["p"].grad_fn is None
    assert torch.equal(loaded["p"], param.detach() * 2)
    assert loaded["t"].is_contiguous()
    assert torch.equal(loaded["t"], transposed)
    # A slice must not drag its 4 MB storage into the file.
    assert store.path("feddyn").stat().st_size < 100_000
    assert torch.equal(loaded["view"], big[:4])


def test_later_save_replaces_earlier_one(store: ClientStateStore) -> None:
    store.save("scaffold", {"c": torch.zeros(2)}, round_num=0)
    store.save("scaffold", {"c": torch.ones(2)}, round_num=1)

    loaded = store.load("scaffold")

    assert loaded.round_num == 1
    assert torch.equal(loaded.state["c"], torch.ones(2))


def test_missing_file_returns_none(store: ClientStateStore) -> None:
    assert store.load("scaffold") is None
    assert store.load("scaffold", expected={"c": ((2,), torch.float32)}) is None


def test_clear_removes_the_file_and_tolerates_absence(store: ClientStateStore) -> None:
    store.save("moon", {"prev": torch.ones(1)}, round_num=0)

    store.clear("moon")
    store.clear("moon")

    assert store.load("moon") is None
    assert not store.path("moon").exists()


def test_state_survives_a_fresh_process_using_the_default_root(tmp_path: Path) -> None:
    # Mimics `nvflare simulator -n 3`: a new process per client-round, cwd = the site workspace.
    code = textwrap.dedent(
        """
        import torch
        from lightning_modules.state_store import ClientStateStore, default_state_root
        store = ClientStateStore(default_state_root(), "site-2")
        store.save("scaffold", {"c_i": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, round_num=4)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != state_store.STATE_DIR_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))

    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=120)
    loaded = ClientStateStore(tmp_path / "client_state", "site-2").load(
        "scaffold", expected={"c_i": ((2, 3), torch.float32)}
    )

    assert loaded is not None
    assert loaded.round_num == 4
    assert torch.equal(loaded.state["c_i"], torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_default_root_follows_env_var_then_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(state_store.STATE_DIR_ENV, raising=False)
    assert default_state_root() == tmp_path / "client_state"

    monkeypatch.setenv(state_store.STATE_DIR_ENV, "elsewhere")
    assert default_state_root() == tmp_path / "elsewhere"

    monkeypatch.setenv(state_store.STATE_DIR_ENV, str(tmp_path / "abs"))
    assert default_state_root() == tmp_path / "abs"


def test_sites_and_algorithms_do_not_collide(tmp_path: Path) -> None:
    site1 = ClientStateStore(tmp_path, "site-1")
    site2 = ClientStateStore(tmp_path, "site-2")

    site1.save("scaffold", {"x": torch.full((2,), 1.0)}, round_num=1)
    site1.save("feddyn", {"x": torch.full((2,), 2.0)}, round_num=2)
    site2.save("scaffold", {"x": torch.full((2,), 3.0)}, round_num=3)

    assert len({site1.path("scaffold"), site1.path("feddyn"), site2.path("scaffold")}) == 3
    assert torch.equal(site1.load("scaffold").state["x"], torch.full((2,), 1.0))
    assert torch.equal(site1.load("feddyn").state["x"], torch.full((2,), 2.0))
    assert torch.equal(site2.load("scaffold").state["x"], torch.full((2,), 3.0))
    assert site2.load("feddyn") is None


def _files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_failing_serialisation_keeps_previous_file_and_leaves_no_temp(store: ClientStateStore, monkeypatch) -> None:
    store.save("scaffold", {"c": torch.ones(3)}, round_num=1)
    before = store.path("scaffold").read_bytes()

    def broken_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        f.write(b"partial bytes")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        store.save("scaffold", {"c": torch.zeros(3)}, round_num=2)

    assert store.path("scaffold").read_bytes() == before
    assert _files_in(store.path("scaffold").parent) == ["scaffold.state"]


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_failing_file_write_keeps_previous_file_and_leaves_no_temp(
    store: ClientStateStore, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    store.save("scaffold", {"c": torch.ones(3)}, round_num=1)
    before = store.path("scaffold").read_bytes()

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError(f"{failing} failed")

    # The temp file exists and holds the new bytes at this point; only the final steps fail.
    monkeypatch.setattr(state_store.os, failing, boom)
    with pytest.raises(OSError, match=f"{failing} failed"):
        store.save("scaffold", {"c": torch.zeros(3)}, round_num=2)
    monkeypatch.undo()

    assert store.path("scaffold").read_bytes() == before
    assert _files_in(store.path("scaffold").parent) == ["scaffold.state"]
    assert store.load("scaffold").round_num == 1


def test_corrupted_payload_byte_is_a_checksum_error(store: ClientStateStore) -> None:
    path = store.save("scaffold", {"c": torch.ones(100)}, round_num=1)
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0xFF
    path.write_bytes(bytes(raw))

    with pytest.raises(StateStoreError, match=PROBLEM + "payload checksum mismatch") as err:
        store.load("scaffold")
    assert "site-1" in str(err.value)
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_corrupted_header_byte_is_a_checksum_error(store: ClientStateStore) -> None:
    path = store.save("scaffold", {"c": torch.ones(2)}, round_num=1)
    raw = bytearray(path.read_bytes())
    raw[raw.index(b'"round_num": 1') + len(b'"round_num": ')] = ord("7")
    path.write_bytes(bytes(raw))

    with pytest.raises(StateStoreError, match=PROBLEM + "header checksum mismatch"):
        store.load("scaffold")


@pytest.mark.parametrize("keep", [0.5, 0.1, 0.001])
def test_truncated_file_is_reported(store: ClientStateStore, keep: float) -> None:
    path = store.save("scaffold", {"c": torch.ones(100)}, round_num=1)
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])

    with pytest.raises(StateStoreError, match=PROBLEM + "truncated file"):
        store.load("scaffold")


def test_empty_file_and_foreign_file_are_reported(store: ClientStateStore) -> None:
    path = store.path("scaffold")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    with pytest.raises(StateStoreError, match=PROBLEM + "truncated file"):
        store.load("scaffold")

    torch.save({"c": torch.ones(2)}, path)  # a plain torch file is not ours
    with pytest.raises(StateStoreError, match=PROBLEM + "not a client state file"):
        store.load("scaffold")


def test_trailing_garbage_is_reported(store: ClientStateStore) -> None:
    path = store.save("scaffold", {"c": torch.ones(2)}, round_num=1)
    path.write_bytes(path.read_bytes() + b"junk")

    with pytest.raises(StateStoreError, match=PROBLEM + r"corrupt file \(4 extra bytes\)"):
        store.load("scaffold")


def test_file_from_another_site_is_rejected(tmp_path: Path) -> None:
    site1 = ClientStateStore(tmp_path, "site-1")
    site2 = ClientStateStore(tmp_path, "site-2")
    site2.path("scaffold").parent.mkdir(parents=True)
    site2.path("scaffold").write_bytes(site1.save("scaffold", {"c": torch.ones(2)}, round_num=1).read_bytes())

    with pytest.raises(StateStoreError, match="site 'site-2'.*" + PROBLEM + "file belongs to site 'site-1'"):
        site2.load("scaffold")


def test_file_of_another_algorithm_is_rejected(store: ClientStateStore) -> None:
    store.path("feddyn").write_bytes(store.save("scaffold", {"c": torch.ones(2)}, round_num=1).read_bytes())

    with pytest.raises(StateStoreError, match=PROBLEM + "file holds algorithm 'scaffold', expected 'feddyn'"):
        store.load("feddyn")


def test_unsupported_version_is_rejected(store: ClientStateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(state_store, "FORMAT_VERSION", FORMAT_VERSION + 1)
        store.save("scaffold", {"c": torch.ones(2)}, round_num=1)

    with pytest.raises(StateStoreError, match=PROBLEM + f"unsupported format version {FORMAT_VERSION + 1}"):
        store.load("scaffold")


def test_expected_spec_accepts_matching_state(store: ClientStateStore) -> None:
    store.save("scaffold", {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.float64), "k": 5}, round_num=1)

    loaded = store.load("scaffold", expected={"w": (torch.Size([2, 3]), torch.float32), "b": ((3,), torch.float64)})

    assert loaded is not None
    assert loaded.state["k"] == 5


@pytest.mark.parametrize(
    ("expected", "message"),
    [
        ({"w": ((3, 2), torch.float32), "b": ((3,), torch.float32)}, r"shape mismatch for key 'w'.*\(2, 3\)"),
        ({"w": ((2, 3), torch.float64), "b": ((3,), torch.float32)}, r"dtype mismatch for key 'w'.*torch\.float32"),
        ({"w": ((2, 3), torch.float32), "b": ((3,), torch.float32), "z": ((1,), torch.float32)}, "missing key 'z'"),
        ({"w": ((2, 3), torch.float32)}, r"unexpected tensor keys \['b'\]"),
        ({"w": ((2, 3), torch.float32), "b": ((3,), torch.float32), "k": ((), torch.int64)}, "key 'k' is a int"),
    ],
    ids=["shape", "dtype", "missing", "extra", "not-a-tensor"],
)
def test_expected_spec_mismatch_names_the_key(store: ClientStateStore, expected, message: str) -> None:
    store.save("scaffold", {"w": torch.zeros(2, 3), "b": torch.zeros(3), "k": 5}, round_num=1)

    with pytest.raises(StateStoreError, match=PROBLEM + message):
        store.load("scaffold", expected=expected)


def test_float64_is_kept_as_given(store: ClientStateStore) -> None:
    value = torch.tensor([1 / 3], dtype=torch.float64)
    store.save("feddyn", {"h": value}, round_num=1)

    loaded = store.load("feddyn").state["h"]

    assert loaded.dtype == torch.float64
    assert _bits_equal(loaded, value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_floats_are_rejected_by_key(store: ClientStateStore, dtype: torch.dtype) -> None:
    with pytest.raises(StateStoreError, match=PROBLEM + rf"key 'c' has dtype {dtype}.*float32 or float64"):
        store.save("scaffold", {"ok": torch.ones(2), "c": torch.ones(2, dtype=dtype)}, round_num=1)
    with pytest.raises(StateStoreError, match=PROBLEM + r"key 'hist\[1\]\.w' has dtype"):
        store.save("moon", {"hist": [torch.ones(1), {"w": torch.ones(1, dtype=dtype)}]}, round_num=1)

    assert not store.path("scaffold").exists()
    assert not store.path("moon").exists()


def test_integer_and_bool_tensors_are_allowed(store: ClientStateStore) -> None:
    state = {"n": torch.tensor([3], dtype=torch.int32), "mask": torch.tensor([True, False])}
    store.save("fednova", state, round_num=0)

    loaded = store.load("fednova").state

    assert _bits_equal(loaded["n"], state["n"])
    assert _bits_equal(loaded["mask"], state["mask"])


@pytest.mark.parametrize(
    ("state", "round_num", "message"),
    [
        ({"x": object()}, 1, "key 'x' has unsupported type object"),
        ({1: torch.ones(1)}, 1, "state keys must be str"),
        ({"x": torch.ones(1)}, -1, "round_num must be a non-negative int"),
        ({"x": torch.ones(1)}, True, "round_num must be a non-negative int"),
    ],
    ids=["object", "int-key", "negative-round", "bool-round"],
)
def test_bad_save_arguments_are_rejected(store: ClientStateStore, state, round_num, message: str) -> None:
    with pytest.raises(StateStoreError, match=PROBLEM + message):
        store.save("scaffold", state, round_num=round_num)


@pytest.mark.parametrize("name", ["", "../escape", "a/b", ".hidden", "with space"])
def test_names_that_are_not_safe_file_names_are_rejected(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="site_name"):
        ClientStateStore(tmp_path, name)
    with pytest.raises(ValueError, match="algorithm"):
        ClientStateStore(tmp_path, "site-1").path(name)


def _pending_store(tmp_path, committed: float, pending: float, pending_round: int) -> ClientStateStore:
    store = ClientStateStore(tmp_path, "site-2")
    store.save("scaffold", {"c": torch.tensor([committed])}, round_num=0)
    store.save("scaffold", {"c": torch.tensor([pending])}, round_num=pending_round, pending=True)
    return store


@pytest.mark.parametrize(
    ("round_num", "last_aggregated", "outcome", "value"),
    [
        (3, {"site-2": 2, "site-1": 2}, "committed", 2.0),  # the server aggregated this site's round-2 result
        (3, {"site-2": 1}, "discarded", 1.0),  # round 2 aggregated without it (rejected or late)
        (3, {}, "discarded", 1.0),  # never aggregated
        (5, {"site-2": 2}, "committed", 2.0),  # sat out rounds 3 and 4: the confirmation still names round 2
        (2, {"site-2": 2}, "discarded", 1.0),  # round 2 trained again: a replay starts from the committed state
        (3, None, "committed", 2.0),  # a server that sends no confirmations: commit, as before
    ],
)
def test_pending_state_is_committed_only_when_the_server_confirms_it(
    tmp_path, round_num, last_aggregated, outcome, value
):
    store = _pending_store(tmp_path, committed=1.0, pending=2.0, pending_round=2)
    assert float(store.load("scaffold").state["c"]) == 1.0  # pending state is not read before it is settled
    assert store.settle("scaffold", round_num, last_aggregated) == outcome
    assert float(store.load("scaffold").state["c"]) == value
    assert not store.pending_path("scaffold").exists()
    assert store.settle("scaffold", round_num, last_aggregated) is None  # nothing left to settle


def test_a_write_killed_before_its_rename_leaves_litter_that_readers_skip_and_the_next_save_removes(
    store: ClientStateStore,
) -> None:
    store.save("scaffold", {"c": torch.ones(2)}, round_num=1, pending=True)
    pending = store.pending_path("scaffold")
    # What a SIGKILL between mkstemp and os.replace leaves (the test of a site killed mid-job met it).
    litter = [pending.parent / f".{pending.name}.k1ll3d.tmp", pending.parent / f".{store.path('x').name}.zz.tmp"]
    for path in litter:
        path.write_bytes(b"half a file")
    assert store.settle("scaffold", 2, {"site-1": 1}) == "committed"
    assert torch.equal(store.load("scaffold").state["c"], torch.ones(2))
    store.save("scaffold", {"c": torch.zeros(2)}, round_num=2, pending=True)
    assert not litter[0].exists() and litter[1].exists()  # only the temporaries of the file being written
