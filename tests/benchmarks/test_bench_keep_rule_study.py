"""The counterfactuals of benchmarks/keep_rule_study.py: the probability average of recent federated models, a
local-only model whose training stops at a validation plateau (a weaker baseline the site does not use), and
federated models shifted towards the site's label frequencies."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.keep_rule_study import (
    COUNTERFACTUAL_RULES,
    RULES,
    label_distance,
    label_prior,
    prior_shifted,
    recent_ensemble,
    replay_site,
    study,
)


def test_the_recent_ensemble_is_the_log_of_the_mean_probability():
    first = {"val": np.log(np.array([[0.9, 0.1], [0.2, 0.8]]))}
    second = {"val": np.log(np.array([[0.5, 0.5], [0.6, 0.4]]))}
    expected = np.log(np.array([[0.7, 0.3], [0.4, 0.6]]))
    np.testing.assert_allclose(recent_ensemble([first, second])["val"], expected, atol=1e-12)


def _tables(p_right: float, n: int = 4) -> dict[str, np.ndarray]:
    """Every sample's true class (0) at probability ``p_right`` on every split."""
    row = np.log(np.array([p_right, 1 - p_right]))
    return {split: np.tile(row, (n, 1)) for split in ("val", "test")}


def _write_rounds(folder, local_p: list[float], global_p: float = 0.5) -> list:
    paths = []
    labels = np.zeros(4, dtype=np.int64)
    for r, p in enumerate(local_p):
        arrays = {
            f"{m}__{s}": t
            for m, tables in (("local", _tables(p)), ("global", _tables(global_p)))
            for s, t in tables.items()
        }
        arrays.update({"labels__val": labels, "labels__test": labels})
        path = folder / f"site-1_r{r}.npz"
        np.savez(path, **arrays)
        paths.append(path)
    return paths


def test_a_local_patience_freezes_the_own_model_at_its_plateau(tmp_path):
    # The local-only model's validation improves at round 0, not at rounds 1-2, and again at round 3: with patience
    # 2 its training has stopped by then, so the own model stays round 0's; without, it is round 3's.
    paths = _write_rounds(tmp_path, [0.6, 0.55, 0.58, 0.9])
    rule = RULES["margin=1.0"]
    full = replay_site(paths, rule)
    stopped = replay_site(paths, rule, local_patience=2)
    assert math.isclose(full[-1]["kept_val_loss"], -math.log(0.9))
    assert math.isclose(stopped[-1]["kept_val_loss"], -math.log(0.6))
    assert [row["kept_val_loss"] for row in full[:3]] == [row["kept_val_loss"] for row in stopped[:3]]


def test_a_window_offers_the_average_of_the_recent_global_models(tmp_path):
    # The two rounds' global models are each right (p 0.95) on half the samples and wrong (p 0.3) on the other
    # half, the other half each time: alone each loses to the own model (p 0.6 everywhere; a mixture with a little
    # of either is slightly better), their average (p 0.625 everywhere) beats all of them and is kept.
    labels = np.zeros(4, dtype=np.int64)
    halves = (np.array([0.95, 0.95, 0.3, 0.3]), np.array([0.3, 0.3, 0.95, 0.95]))
    for r, p_right in enumerate(halves):
        tables = {
            "local": _tables(0.6),
            "global": {s: np.log(np.stack([p_right, 1 - p_right], 1)) for s in ("val", "test")},
        }
        arrays = {f"{m}__{s}": t for m, by in tables.items() for s, t in by.items()}
        arrays.update({"labels__val": labels, "labels__test": labels})
        np.savez(tmp_path / f"site-1_r{r}.npz", **arrays)
    paths = sorted(tmp_path.glob("*.npz"))
    plain = replay_site(paths, RULES["margin=0.0"])
    windowed = replay_site(paths, RULES["margin=0.0"], window=2)
    assert plain[0] == windowed[0]  # one round: nothing to average
    assert math.isclose(windowed[-1]["kept_val_loss"], -math.log(0.625))
    assert plain[-1]["kept_val_loss"] > -math.log(0.625) + 0.03


def test_the_label_prior_adds_one_to_every_count():
    np.testing.assert_allclose(label_prior(np.array([0, 0, 0, 1]), 3), [4 / 7, 2 / 7, 1 / 7], atol=1e-12)


def test_a_prior_shift_multiplies_the_probabilities_by_the_prior_to_the_tau_and_renormalises():
    tables = {"val": np.log(np.array([[0.5, 0.5], [0.2, 0.8]]))}
    prior = np.array([2 / 3, 1 / 3])
    # tau = 1: [0.5 * 2/3, 0.5 * 1/3] / 0.5 = [2/3, 1/3]; [0.2 * 2/3, 0.8 * 1/3] / (0.4) = [1/3, 2/3].
    np.testing.assert_allclose(np.exp(prior_shifted(tables, prior, 1.0)["val"]), [[2 / 3, 1 / 3], [1 / 3, 2 / 3]])
    # tau = 0 leaves the model as it is.
    np.testing.assert_allclose(prior_shifted(tables, prior, 0.0)["val"], tables["val"], atol=1e-12)


def test_a_prior_shifted_global_model_is_offered_and_kept_where_the_site_labels_are_skewed(tmp_path):
    # Validation labels 0, 0, 0, 1 (prior with Laplace smoothing: 2/3, 1/3); the global model says 0.5 / 0.5 on every
    # sample, the own model is poor (p 0.3 on the true class). Shifted with tau = 1, the global model gives the
    # three class-0 samples 2/3 and the class-1 sample 1/3: mean loss -(3 ln 2/3 + ln 1/3)/4, below ln 2.
    labels = np.array([0, 0, 0, 1])
    flat = np.log(np.full((4, 2), 0.5))
    own = np.log(np.array([[0.3, 0.7]] * 3 + [[0.7, 0.3]]))
    arrays = {"local__val": own, "local__test": own, "global__val": flat, "global__test": flat}
    arrays.update({"labels__val": labels, "labels__test": labels})
    np.savez(tmp_path / "site-1_r0.npz", **arrays)
    paths = [tmp_path / "site-1_r0.npz"]
    plain = replay_site(paths, RULES["margin=0.0"])
    shifted = replay_site(paths, RULES["margin=0.0"], prior_shift=[1.0])
    expected = -(3 * math.log(2 / 3) + math.log(1 / 3)) / 4
    assert expected < math.log(2)
    assert math.isclose(shifted[0]["kept_val_loss"], expected, abs_tol=1e-9)
    assert plain[0]["kept_val_loss"] > expected + 0.05


def test_a_loss_of_one_test_sample_in_four_is_counted_below_two_points_and_within_test_noise(tmp_path):
    # The received model is better on validation (p 0.9 against the own model's 0.6) and is kept; on the test split
    # it misses one sample of four that the own model gets: -25 points. The paired differences 0, 0, 0, -1 have
    # standard deviation 0.5, so the standard error is 0.25 (25 points), and 25 <= 1.96 * 25: within the noise.
    run = tmp_path / "setting" / "fedavgm__x__s0"
    run.mkdir(parents=True)
    labels = np.zeros(4, dtype=np.int64)
    own = np.log(np.tile([0.6, 0.4], (4, 1)))
    received_test = np.log(np.array([[0.9, 0.1]] * 3 + [[0.1, 0.9]]))
    arrays = {"local__val": own, "local__test": own, "global__val": np.log(np.tile([0.9, 0.1], (4, 1))),
              "global__test": received_test, "labels__val": labels, "labels__test": labels}  # fmt: skip
    np.savez(run / "site-1_r0.npz", **arrays)
    result = study(tmp_path / "setting", RULES["margin=0.0"], patience=None)
    assert result["worst"] == -25.0
    assert result["below2"] == 1 and result["below2_within_noise"] == 1
    assert math.isclose(result["finals"]["fedavgm__x__s0"]["sites"]["site-1"]["test_difference_se"], 0.25)
    assert result["val_test_label_distance"] == [0.0, 0.0]  # both splits hold four samples of label 0


def test_the_label_distance_is_half_the_summed_share_difference():
    # Shares (3/4, 1/4, 0) and (1/4, 1/4, 1/2): |1/2| + 0 + |1/2|, halved: 1/2.
    assert math.isclose(label_distance(np.array([0, 0, 0, 1]), np.array([0, 1, 2, 2])), 0.5)
    assert label_distance(np.array([1, 0]), np.array([0, 1])) == 0.0
    assert label_distance(np.array([0, 0]), np.array([1, 1])) == 1.0


def test_prefer_keeps_the_federated_model_in_a_tie_and_the_own_model_only_when_it_is_better(tmp_path):
    """``prefer=1.0`` turns the margin round: a tie on validation (the same probabilities) goes to the federated
    model, where the shipped rule keeps the own one; an own model better on every sample (standard error 0) stays."""
    (tmp_path / "tie").mkdir()
    (tmp_path / "better").mkdir()
    tie = _write_rounds(tmp_path / "tie", [0.6], global_p=0.6)
    assert replay_site(tie, RULES["margin=1.0"])[-1]["kept_own"] == 1.0
    assert replay_site(tie, COUNTERFACTUAL_RULES["prefer=1.0"])[-1]["kept_own"] == 0.0
    better = _write_rounds(tmp_path / "better", [0.6], global_p=0.5)
    assert replay_site(better, COUNTERFACTUAL_RULES["prefer=1.0"])[-1]["kept_own"] == 1.0
