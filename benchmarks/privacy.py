"""Leakage measured: membership-inference attacks on the final global model of a federation.

    python -m benchmarks.privacy --out benchmarks/results/privacy.md                   # the committed page
    python -m benchmarks.privacy --tasks fmnist --seeds 0 --shadows 2 --rounds 1 ...   # a quick look
    python -m benchmarks.privacy --set dp_noise_multiplier=1.0 --set dp_max_grad_norm=1.0   # any JobSpec setting
    python -m benchmarks.privacy --grid --rounds 3 --shadows 2 --out benchmarks/results/privacy.md  # utility vs privacy

Two attacks, scored on an *audit set* of records whose membership is known (members: the records some site of the
target federation trained on; non-members: records of the same distribution no site trained on):

- **loss threshold** (Yeom, Giacomelli, Fredrikson, Jha, CSF 2018): score = -loss of the record under the target
  model; no shadow model.
- **LiRA, offline** (Carlini, Chien, Nasr, Song, Terzis, Tramèr, S&P 2022): ``--shadows`` shadow federations are run
  with the target's protocol on other random draws of the data (other seeds); for each audit record, the shadows
  that did not train on it give its "out" distribution of the logit-scaled confidence
  phi = log(p_y / (1 - p_y)), fitted by a Gaussian with a per-record mean and one variance pooled over all
  records (the paper's choice with few shadows); the score is the standardised (phi_target - mu_out) / sigma_out, a
  monotone function of the one-sided likelihood ratio. Records with no "out" shadow are left out (counted).

Reported per task and target seed: attack AUC, TPR at 1 % and 0.1 % FPR (the resolution is 1 / non-members), and the
target's test accuracy; then the mean and standard deviation over seeds. Without ``--personal`` only the final global
model is attacked (FedAvg, SCAFFOLD and FedAdam keep no personalized model); ``--grid --personal TASK:METHOD[=ROUNDS]``
(`PERSONAL_METHODS`: FedPer, FedRep, Ditto, fine-tuning) also attacks each site's personal model, the threat
being a curious insider at the site: members are the site's training records, non-members its validation records
(`personal_attacks`).

Tasks (small on purpose: a 2-core CPU shared by others; the protocol is written into the page):

- ``fmnist``: Fashion-MNIST, LeNet-5, 3 sites Dirichlet(0.5) over a seeded subset of the training images; the
  audit set is the three targets' members plus as many other training images;
- ``1kg``: the 1000 Genomes AISNP panel (examples/genomics, the consortium's data module and model, MLP), 3 sites
  Dirichlet(0.5) over the people outside the fixed 20 % test set; every site keeps half of its share out of training
  (its validation split), so each person is a member of about 40 % of the federations; the audit set is everyone.

``--set KEY=VALUE`` applies any `jobs.spec.JobSpec` setting (VALUE is JSON) to the targets and the shadows
alike: a server rule (``server=dp_fedavg`` with ``server_args={...}``) or the sites' DP-SGD settings, so the same
command measures a private federation. Every federation's scores are kept under ``--work`` and never recomputed.

``--grid`` measures utility against privacy: every (task, method, ε) cell, methods `METHODS` (FedAvg, SCAFFOLD
Option II, FedAdam), DP-SGD at every site calibrated to each ``--epsilons`` budget (``inf``: no DP), the loss attack
everywhere and LiRA for the ``--attacked`` methods; the global test accuracy, each site's accuracy scored here
(`site_weighted_accuracy`, since DP sites withhold their own scores) and the ε the sites reached. It writes a
marked section into ``--out`` (the rest of the page stays), ``<stem>_dp.json`` and ``<stem>_dp.png``;
``--cached-only`` writes what ``--work`` holds and names the missing cells. ``--more-rounds TASK:METHOD=N`` also runs
that task's method, every budget, at N rounds (rows with a 'rounds' column): the section compares each task's no-DP
FedAvg accuracy across the round counts it has (and the no-DP section's) and says which rows are undertrained.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.compare import mean_std

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FPRS = (0.01, 0.001)
TARGET_SEEDS = (0, 1, 2)
SHADOW_SEED0 = 100  # shadow federations use seeds SHADOW_SEED0, SHADOW_SEED0 + 1, ...


# --------------------------------------------------------------------------------------------------------------------
# Attack statistics (pure)
# --------------------------------------------------------------------------------------------------------------------
def roc_auc(members: np.ndarray, non_members: np.ndarray) -> float:
    """P(score of a member > score of a non-member), ties counting one half (Mann-Whitney U / (n1 n0))."""
    scores = np.concatenate([members, non_members])
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # Average ranks over ties.
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
    ends = np.r_[starts[1:], len(scores)]
    for start, end in zip(starts, ends, strict=True):
        ranks[order[start:end]] = (start + end + 1) / 2
    n1, n0 = len(members), len(non_members)
    return float((ranks[:n1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def tpr_at_fpr(members: np.ndarray, non_members: np.ndarray, fpr: float) -> float:
    """The share of members scored above a threshold that at most ``fpr`` of the non-members exceed."""
    ranked = np.sort(non_members)[::-1]
    allowed = math.floor(fpr * len(ranked))
    threshold = ranked[allowed] if allowed < len(ranked) else -np.inf
    return float(np.mean(members > threshold))


def logit_confidence(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(loss, phi) per record: cross-entropy and log(p_y / (1 - p_y)), both from the logits in float64 with
    log-sum-exp, so a confident model does not round p_y to 1."""
    z = np.asarray(logits, dtype=np.float64)
    true = z[np.arange(len(z)), labels]
    top = z.max(axis=1, keepdims=True)
    log_total = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))
    others = z.copy()
    others[np.arange(len(z)), labels] = -np.inf
    top_others = others.max(axis=1, keepdims=True)
    log_others = top_others[:, 0] + np.log(np.exp(others - top_others).sum(axis=1))
    return log_total - true, true - log_others


def lira_offline_scores(
    target_phi: np.ndarray, shadow_phi: np.ndarray, shadow_in: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(score, usable) per record: (phi - mu_out) / sigma_out with mu_out the mean over the shadows that did not
    train on the record (``shadow_in`` False) and sigma_out pooled over every record's out shadows; ``usable`` is
    False for a record no shadow left out."""
    out = ~np.asarray(shadow_in, dtype=bool)
    counts = out.sum(axis=0)
    usable = counts > 0
    mu = np.where(usable, (shadow_phi * out).sum(axis=0) / np.maximum(counts, 1), 0.0)
    residuals = (shadow_phi - mu)[out]
    dof = max(int(out.sum()) - int(usable.sum()), 1)
    sigma = max(math.sqrt(float((residuals**2).sum()) / dof), 1e-12)
    return (target_phi - mu) / sigma, usable


def attack_metrics(scores: np.ndarray, is_member: np.ndarray) -> dict[str, float]:
    """AUC and TPR at each of `FPRS` for one attack's scores."""
    members, non_members = scores[is_member], scores[~is_member]
    values = {"auc": roc_auc(members, non_members)}
    for fpr in FPRS:
        values[f"tpr@{fpr:g}"] = tpr_at_fpr(members, non_members, fpr)
    return values


# --------------------------------------------------------------------------------------------------------------------
# Tasks: the federation's settings, the audit set and who trained on what
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    name: str
    settings: Callable[[int, int], dict[str, Any]]  # (seed, rounds) -> JobSpec values
    rounds: int


def fmnist_settings(seed: int, rounds: int) -> dict[str, Any]:
    return dict(
        dataset="fashion_mnist",
        arch="lenet5",
        num_sites=3,
        scheme="dirichlet",
        alpha=0.5,
        max_train_samples=1500,
        max_test_samples=2000,
        epochs=2,
        batch_size=32,
        lr=0.05,
        num_rounds=rounds,
        seed=seed,
    )


def genomics_settings(seed: int, rounds: int) -> dict[str, Any]:
    return dict(
        model="genomics.model:SnpClassifier",
        model_args={"arch": "mlp", "n_snps": 127, "num_classes": 5, "lr": 1e-3},
        data="genomics.data:SnpSites",
        data_args={
            "source": "1kg",
            "split": "dirichlet",
            "alpha": 0.5,
            "val_fraction": 0.5,
            "batch_size": 32,
            "seed": seed,
        },
        ship=str(EXAMPLES / "genomics"),
        num_sites=3,
        epochs=2,
        num_rounds=rounds,
        seed=seed,
    )


TASKS = {"fmnist": Task("fmnist", fmnist_settings, 10), "1kg": Task("1kg", genomics_settings, 10)}
#: The protocol of each task in words, for the page.
PROTOCOLS = {
    "fmnist": (
        "Fashion-MNIST, LeNet-5, 3 sites Dirichlet(0.5) over a seeded subset of 1,500 training images, 2 local "
        "epochs per round, batch 32, SGD lr 0.05; audit set: the three targets' members and as many other training "
        "images; test accuracy on the first 2,000 test images"
    ),
    "1kg": (
        "1000 Genomes AISNP panel (2,504 people, 127 SNPs, 5 super-populations), the genomics example's MLP, 3 sites "
        "Dirichlet(0.5) over the 80 % outside the fixed test set, each site training on half of its share (the other "
        "half is its validation split), 2 local epochs per round, batch 32, AdamW lr 1e-3; audit set: everyone; test "
        "accuracy on the fixed 20 % test set"
    ),
}


def record_keys(x: np.ndarray, y: np.ndarray) -> list[bytes]:
    """One key per record (its features and label): how membership is told, whatever the loaders' indexing."""
    # One dtype whatever the loader's (int8 genotypes in the panel, int64 in the data module's tensors).
    flat = np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(len(x), -1))
    return [row.tobytes() + int(label).to_bytes(2, "little") for row, label in zip(flat, np.asarray(y), strict=True)]


Records = tuple[np.ndarray, np.ndarray]  # (x, y)


def site_splits(spec: Any) -> list[tuple[Records, Records]]:
    """Every site's (training split, validation split) of ``spec``, in site order: a user data module's splits, or a
    built-in site's shard split as the site splits it (``site_val_fraction``; an empty validation split without
    it). The validation split is the site's held-out share: the same distribution as its training split, never
    trained on."""
    if spec.model is None:
        from benchmarks.in_process import site_args
        from data_prep import SiteDataConfig, site_split
        from data_prep.site_config import seed_index
        from lightning_modules.site import validation_indices

        config, splits = SiteDataConfig.from_namespace(site_args(spec)), []
        for i in range(spec.num_sites):
            x, y = site_split(config, f"site-{i + 1}")
            index = seed_index(f"site-{i + 1}", spec.num_sites)
            train, val = validation_indices(len(y), spec.site_val_fraction, spec.seed, index)
            splits.append(((x[train], y[train]), (x[val], y[val])))
        return splits
    from lightning_modules.own_model import build_user_data

    splits = []
    for i in range(spec.num_sites):
        data = build_user_data(spec.data, spec.data_args, f"site-{i + 1}", spec.num_sites)
        splits.append(tuple(tuple(t.numpy() for t in part.tensors) for part in (data.train, data.val)))
    return splits


def site_training_records(spec: Any) -> list[Records]:
    """Every site's training split ``(x, y)`` of ``spec``, in site order."""
    return [train for train, _ in site_splits(spec)]


def training_records(spec: Any) -> tuple[np.ndarray, np.ndarray]:
    """Every record some site of ``spec`` trains on (the sites' training splits, concatenated)."""
    parts = site_training_records(spec)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def site_weighted_accuracy(correct: np.ndarray, test_y: np.ndarray, site_y: np.ndarray, num_classes: int) -> float:
    """A site's accuracy estimated on the shared test set: the per-class test accuracy weighted by the class shares
    of the site's training labels (its label skew). Under DP the sites' own scores stay at the sites, so the
    benchmark scores the final model this way, outside the federation; a class absent from the test set counts 0."""
    shares = np.bincount(np.asarray(site_y), minlength=num_classes) / len(site_y)
    per_class = np.array([np.mean(correct[test_y == c]) if np.any(test_y == c) else 0.0 for c in range(num_classes)])
    return float(shares @ per_class)


def population(spec: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(training pool x, y, test x, y) of the task: the records members and non-members are drawn from, and the
    held-out test set the target's accuracy is measured on."""
    if spec.model is None:
        from data_prep import load_dataset

        data = load_dataset(spec.dataset)
        return data.train_x, data.train_y, data.test_x[: spec.max_test_samples], data.test_y[: spec.max_test_samples]
    from data_prep.genomics import held_out_split, source_data

    data = source_data(spec.data_args["source"])
    x, y = np.asarray(data.genotypes), np.asarray(data.labels)
    _, test = held_out_split(y, 0.2)
    return x, y, x[test], y[test]


def module_with(spec: Any, params: Mapping[str, np.ndarray]) -> Any:
    """The job's model holding ``params``, in eval mode."""
    import torch

    if spec.model is None:
        from jobs.spec import dataset_num_classes, model_arch_args
        from lightning_modules.classifier import FLClassifier

        arch_args = model_arch_args(spec) or None
        module = FLClassifier(arch=spec.arch, num_classes=dataset_num_classes(spec.dataset), arch_args=arch_args)
    else:
        from lightning_modules.own_model import build_user_module

        module = build_user_module(spec.model, spec.model_args, seed=spec.seed)
    module.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in params.items()})
    return module.eval()


def model_logits(module: Any, x: np.ndarray, batch: int = 1024) -> np.ndarray:
    import torch

    tensor_type = torch.long if np.issubdtype(np.asarray(x).dtype, np.integer) else torch.float32
    with torch.no_grad():
        return np.concatenate(
            [module(torch.tensor(x[i : i + batch], dtype=tensor_type)).float().numpy() for i in range(0, len(x), batch)]
        )


# --------------------------------------------------------------------------------------------------------------------
# Running federations
# --------------------------------------------------------------------------------------------------------------------
def build_spec(task: Task, seed: int, rounds: int, overrides: Mapping[str, Any]) -> Any:
    from jobs.spec import spec_from_values

    return spec_from_values(f"privacy_{task.name}_s{seed}", {**task.settings(seed, rounds), **overrides})


def federation_scores(
    spec: Any, audit_x: np.ndarray, audit_y: np.ndarray, test: tuple, personal: bool = False
) -> dict[str, Any]:
    """Run ``spec``'s federation in process; its final model's loss and phi on the audit set, its test accuracy;
    with ``personal``, also every site's personal model's loss, phi and correctness on the audit set (sites x
    records; `benchmarks.personalization.personal_params`), and the global model's correctness."""
    from benchmarks.in_process import quiet_lightning, run_in_process

    started = time.monotonic()
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fedalg_privacy_") as state_root, quiet_lightning():
        run = run_in_process(spec, Path(state_root), evaluate=False, run_id=spec.name)
        if personal:
            rows = [model_logits(module, audit_x) for module in personal_modules(spec, Path(state_root), run.params)]
            scored = [logit_confidence(logits, audit_y) for logits in rows]
            extra = {
                "personal_loss": np.stack([loss for loss, _ in scored]),
                "personal_phi": np.stack([phi for _, phi in scored]),
                "personal_correct": np.stack([logits.argmax(axis=1) == audit_y for logits in rows]),
            }
    module = module_with(spec, run.params)
    audit_logits = model_logits(module, audit_x)
    loss, phi = logit_confidence(audit_logits, audit_y)
    if personal:
        extra["correct"] = audit_logits.argmax(axis=1) == audit_y
    test_logits = model_logits(module, test[0])
    correct = test_logits.argmax(axis=1) == test[1]
    sites = [site_weighted_accuracy(correct, test[1], y, test_logits.shape[1]) for _, y in site_training_records(spec)]
    accuracy = float(np.mean(correct))
    diagnostics = (run.rounds[-1].get("rule_diagnostics") or {}) if run.rounds else {}
    largest = largest_site_epsilon(run.rounds)
    if largest is not None:
        diagnostics["site_epsilon"] = largest
    return {
        "loss": loss,
        "phi": phi,
        "test_accuracy": accuracy,
        "site_accuracy": np.array(sites),
        "wall_s": time.monotonic() - started,
        **extra,
        **diagnostics,
    }


def personal_modules(spec: Any, state_root: Path, final: Mapping[str, np.ndarray]) -> list[Any]:
    """Every site's personal model after ``spec``'s federation (its client state under ``state_root``), in eval
    mode: fine-tuning's copy of the final global model trained ``finetune_epochs`` at the site (seeded as the sites
    seed it), or the final global model with the site's own entries over it (partial sharing, FedRep, Ditto)."""
    from benchmarks.personalization import finetuned, personal_params

    if spec.finetune_epochs:
        from benchmarks.in_process import site_rounds

        return [finetuned(site, final, spec.num_rounds).eval() for site in site_rounds(spec, state_root).values()]
    modules = []
    for i in range(spec.num_sites):
        params = personal_params(spec, state_root, f"site-{i + 1}", final)
        if params is None:
            raise SystemExit(f"error: {spec.name} keeps no personal model (local_keys, finetune_epochs or ditto)")
        modules.append(module_with(spec, params))
    return modules


def largest_site_epsilon(rounds: Sequence[Mapping[str, Any]]) -> float | None:
    """The largest sample-level epsilon any site reached (DP-SGD: each round's ``privacy`` holds the cumulative
    epsilon of every site that trained in it), or None without DP-SGD."""
    found = [p["epsilon"] for r in rounds for p in (r.get("privacy") or {}).values() if p.get("epsilon") is not None]
    return max(found) if found else None


class NotCached(LookupError):
    """A federation a cached-only run would have to compute."""


def cached(path: Path, compute: Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
    """A federation's scores from ``path`` (an .npz), computing and writing them first if absent (``compute`` None:
    `NotCached` instead)."""
    if path.exists():
        with np.load(path, allow_pickle=False) as stored:
            return {key: stored[key] if stored[key].ndim else stored[key].item() for key in stored.files}
    if compute is None:
        raise NotCached(str(path))
    values = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **values)
    return values


def audit_set(task: Task, rounds: int, overrides: Mapping[str, Any], seeds: Sequence[int]) -> dict[str, Any]:
    """The records every model is scored on, and the pool's test split (task docstrings in the module's)."""
    spec = build_spec(task, seeds[0], rounds, overrides)
    pool_x, pool_y, test_x, test_y = population(spec)
    if len(pool_y) <= 5000:  # the genotype panel: everyone
        return {"x": pool_x, "y": pool_y, "test": (test_x, test_y)}
    members = set()
    for seed in seeds:
        # The sites' training records, and their held-out ones (the personal-model attacks' non-members).
        for split in site_splits(build_spec(task, seed, rounds, overrides)):
            for x, y in split:
                if len(y):
                    members.update(record_keys(x, y))
    keys = record_keys(pool_x, pool_y)
    chosen = [i for i, key in enumerate(keys) if key in members]
    others = np.setdiff1d(np.arange(len(keys)), chosen)
    extra = np.random.default_rng(7).choice(others, size=len(chosen), replace=False)
    index = np.sort(np.concatenate([chosen, extra]))
    return {"x": pool_x[index], "y": pool_y[index], "test": (test_x, test_y)}


def membership(spec: Any, audit_keys: Sequence[bytes]) -> np.ndarray:
    trained = set(record_keys(*training_records(spec)))
    return np.array([key in trained for key in audit_keys])


def measure_task(
    task: Task,
    seeds: Sequence[int],
    shadows: int,
    rounds: int,
    overrides: Mapping[str, Any],
    work: Path,
    compute: bool = True,
    personal: bool = False,
) -> dict[str, Any]:
    """Both attacks on every target seed, with one pool of shadow federations shared by the targets; with
    ``personal``, also on every site's personal model (`personal_attacks`)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    audit = audit_set(task, rounds, overrides, seeds)
    keys = record_keys(audit["x"], audit["y"])
    folder = work / task.name / f"r{rounds}"
    if overrides:  # another protocol: other federations
        folder = folder.with_name(
            f"r{rounds}_" + hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:10]
        )

    def scored(seed: int) -> tuple[Any, dict[str, Any]]:
        spec = build_spec(task, seed, rounds, overrides)
        values = cached(
            folder / f"seed{seed}.npz",
            (lambda: federation_scores(spec, audit["x"], audit["y"], audit["test"], personal)) if compute else None,
        )
        print(f"[privacy] {task.name} seed {seed}: test accuracy {float(values['test_accuracy']):.4f}", flush=True)
        return spec, values

    shadow_runs = [scored(SHADOW_SEED0 + j) for j in range(shadows)]
    if shadow_runs:
        shadow_phi = np.stack([values["phi"] for _, values in shadow_runs])
        shadow_in = np.stack([membership(spec, keys) for spec, _ in shadow_runs])
    results, walls = [], [float(values["wall_s"]) for _, values in shadow_runs]
    for seed in seeds:
        spec, values = scored(seed)
        walls.append(float(values["wall_s"]))
        is_member = membership(spec, keys)
        lira, usable = lira_offline_scores(values["phi"], shadow_phi, shadow_in) if shadow_runs else (None, None)
        mine = {}
        if personal:
            # Shadow personal models: every site's of every shadow federation; "in" = the federation trained on it.
            personal_shadows = (
                (
                    np.concatenate([v["personal_phi"] for _, v in shadow_runs]),
                    np.repeat(shadow_in, spec.num_sites, axis=0),
                )
                if shadow_runs
                else None
            )
            mine = {"personal": personal_attacks(spec, keys, values, lira, personal_shadows)}
        results.append(
            {
                **mine,
                "seed": seed,
                "test_accuracy": float(values["test_accuracy"]),
                "site_accuracy": [float(a) for a in values["site_accuracy"]] if "site_accuracy" in values else None,
                "members": int(is_member.sum()),
                "non_members": int((~is_member).sum()),
                "loss": attack_metrics(-values["loss"], is_member),
                "lira": attack_metrics(lira[usable], is_member[usable]) if shadow_runs else None,
                "lira_left_out": int((~usable).sum()) if shadow_runs else None,
                "epsilon": float(values["dp_fedavg.epsilon"]) if "dp_fedavg.epsilon" in values else None,
                "site_epsilon": float(values["site_epsilon"]) if "site_epsilon" in values else None,
            }
        )
    return {
        "task": task.name,
        "rounds": rounds,
        "shadows": shadows,
        "overrides": dict(overrides),
        "federation_minutes": sum(walls) / 60,
        "seeds": results,
    }


def site_attack_metrics(
    scores: np.ndarray, members: Sequence[np.ndarray], non_members: Sequence[np.ndarray]
) -> dict[str, float]:
    """`attack_metrics` of each site's scores (``scores[k]``, or ``scores`` for all sites when 1-D) on its own
    records only: its members against its non-members of the same distribution; the mean over sites."""
    per_site = []
    for k, (inside, outside) in enumerate(zip(members, non_members, strict=True)):
        row = scores[k] if scores.ndim == 2 else scores
        is_member = np.r_[np.ones(int(inside.sum()), bool), np.zeros(int(outside.sum()), bool)]
        per_site.append(attack_metrics(np.concatenate([row[inside], row[outside]]), is_member))
    return {key: float(np.mean([m[key] for m in per_site])) for key in per_site[0]}


def personal_attacks(
    spec: Any,
    keys: Sequence[bytes],
    values: Mapping[str, Any],
    global_lira: np.ndarray | None,
    shadows: tuple[np.ndarray, np.ndarray] | None,
) -> dict[str, Any]:
    """The attacks of a curious insider at site k holding its personal model, against the same records scored by the
    final global model: members are site k's training records, non-members its validation records (the same draw
    of the data, never trained on); metrics per site, then the mean over the sites. LiRA's "out" models are the
    shadow federations' personal models of every site, "out" when that shadow federation did not train on the
    record. Accuracy: each model on the site's own validation records, the mean over the sites."""
    index = {key: i for i, key in enumerate(keys)}
    inside, outside = [], []
    for train, val in site_splits(spec):
        rows = [np.zeros(len(keys), bool), np.zeros(len(keys), bool)]
        for mask, records in zip(rows, (train, val), strict=True):
            mask[[index[key] for key in record_keys(*records)]] = True
        inside.append(rows[0])
        outside.append(rows[1])
    result = {
        "accuracy": float(np.mean([values["personal_correct"][k][m].mean() for k, m in enumerate(outside)])),
        "global_accuracy": float(np.mean([values["correct"][m].mean() for m in outside])),
        "loss": site_attack_metrics(-values["personal_loss"], inside, outside),
        "global_loss": site_attack_metrics(-values["loss"], inside, outside),
        "lira": None,
        "global_lira": None,
    }
    if shadows is not None and global_lira is not None:
        fitted = [lira_offline_scores(phi, *shadows) for phi in values["personal_phi"]]
        scores = np.stack([score for score, _ in fitted])
        usable = fitted[0][1]  # records some shadow left out: the shadows' membership alone decides, for every site
        kept_in, kept_out = [m & usable for m in inside], [m & usable for m in outside]
        result["lira"] = site_attack_metrics(scores, kept_in, kept_out)
        result["global_lira"] = site_attack_metrics(global_lira, kept_in, kept_out)
    return result


# --------------------------------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------------------------------
def _pct(values: Sequence[float]) -> str:
    mean, std = mean_std(values)
    return f"{100 * mean:.1f} ± {100 * std:.1f}"


def task_table(result: Mapping[str, Any]) -> list[str]:
    header = "| seed | test acc. | members / non-members | attack | AUC | TPR @ 1 % FPR | TPR @ 0.1 % FPR |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for row in result["seeds"]:
        for attack in ("loss", "lira"):
            m = row[attack]
            lines.append(
                f"| {row['seed']} | {row['test_accuracy']:.3f} | {row['members']} / {row['non_members']} | "
                f"{ATTACK_NAMES[attack]} | {m['auc']:.3f} | {100 * m['tpr@0.01']:.1f} % | "
                f"{100 * m['tpr@0.001']:.1f} % |"
            )
    for attack in ("loss", "lira"):
        rows = [row[attack] for row in result["seeds"]]
        lines.append(
            f"| mean ± std | {_pct([r['test_accuracy'] for r in result['seeds']])} % | | {ATTACK_NAMES[attack]} | "
            f"{_pct([r['auc'] for r in rows])} % | {_pct([r['tpr@0.01'] for r in rows])} % | "
            f"{_pct([r['tpr@0.001'] for r in rows])} % |"
        )
    return lines


ATTACK_NAMES = {"loss": "loss threshold", "lira": "LiRA offline"}


def best_attack_line(result: Mapping[str, Any]) -> str:
    """The attack with the higher mean TPR at 1 % FPR, against chance (AUC 0.5, TPR = FPR)."""
    means = {a: mean_std([r[a]["tpr@0.01"] for r in result["seeds"]])[0] for a in ATTACK_NAMES}
    attack = max(means, key=means.get)
    aucs = [r[attack]["auc"] for r in result["seeds"]]
    return (
        f"Strongest attack: {ATTACK_NAMES[attack]}, AUC {_pct(aucs)} % and TPR at 1 % FPR "
        f"{100 * means[attack]:.1f} % (chance: 50 % and 1 %)."
    )


def write_page(results: Sequence[Mapping[str, Any]], out: Path, command: str) -> None:
    minutes = sum(result["federation_minutes"] for result in results)
    lines = [
        "# Membership inference against the final global model",
        "",
        f"Command: `{command}` (its federations ran {minutes:.1f} min in all on a shared 2-core CPU, one thread each; "
        "a rerun reads them from `--work`). Method and protocol: "
        "`benchmarks/privacy.py` (module docstring); the privacy guarantees these numbers are to be read against: "
        "[docs/privacy.md](../../docs/privacy.md).",
        "",
        "An attack that guesses does no better than AUC 0.5 and a TPR equal to the FPR; TPR at 0.1 % FPR rests on a "
        "handful of non-members (its resolution is 1 / non-members) and is noisy. Seeds: the target federations' "
        "seeds draw the data subset, the split over the sites and the initial model; the shadows use other seeds.",
        "",
    ]
    for result in results:
        overrides = result["overrides"] or "none (no DP)"
        lines += [
            f"## {result['task']}",
            "",
            f"FedAvg, {result['rounds']} rounds, {result['shadows']} shadow federations (seeds {SHADOW_SEED0}.."
            f"{SHADOW_SEED0 + result['shadows'] - 1}), target seeds "
            f"{', '.join(str(r['seed']) for r in result['seeds'])}; settings over the task's: {overrides}.",
            "",
            PROTOCOLS[result["task"]] + ".",
            "",
            *task_table(result),
            "",
            best_attack_line(result),
            "",
        ]
        epsilons = [row["epsilon"] for row in result["seeds"] if row["epsilon"] is not None]
        if epsilons:
            lines += [f"Client-level epsilon of DP-FedAvg after the last round: {max(epsilons):.3g}.", ""]
        site_eps = [row["site_epsilon"] for row in result["seeds"] if row.get("site_epsilon") is not None]
        if site_eps:
            lines += [
                f"Sample-level epsilon of DP-SGD, the largest site after the last round: {max(site_eps):.3g}.",
                "",
            ]
    text = "\n".join(lines) + "\n"
    if out.exists() and GRID_BEGIN in (previous := out.read_text()):  # the utility-vs-privacy section stays
        text = replace_section(text, [GRID_BEGIN + previous.partition(GRID_BEGIN)[2].partition(GRID_END)[0] + GRID_END])
    out.write_text(text)


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs, VALUE read as JSON when it is JSON (else the text)."""
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: --set takes KEY=VALUE, got {pair!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


# --------------------------------------------------------------------------------------------------------------------
# Utility vs privacy: methods x epsilon budgets (``--grid``)
# --------------------------------------------------------------------------------------------------------------------
#: The federations of the grid: settings over the task's. FedAdam is the server optimizer: server rules see only the
#: sites' DP outputs, so any of them composes with DP-SGD (docs/privacy.md).
METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "scaffold": {"client": "scaffold"},
    "fedadam": {"server": "fedadam"},
}
#: Sample-level budgets at every site (None: no DP), all at delta 1e-5 with clip norm 1.
EPSILONS: tuple[float | None, ...] = (1.0, 3.0, 8.0, None)
DP_SETTINGS = {"dp_max_grad_norm": 1.0, "dp_delta": 1e-5}
GRID_BEGIN, GRID_END = "<!-- privacy-grid:begin -->", "<!-- privacy-grid:end -->"


#: Personalized methods whose site models are attacked too (``--personal TASK:METHOD``): settings over the task's,
#: as the personalization grids have them (benchmarks/genomics.py, benchmarks/compare.py). The personal model never
#: leaves its site: the attack models a curious insider at the site holding it. The built-in sites hold out 40 % of
#: their shard (``site_val_fraction``), as the 1kg data module holds out half: the personal attacks' non-members.
_FMNIST_HELD_OUT = {"site_val_fraction": 0.4}  # the setting allows [0, 0.5)
PERSONAL_METHODS: dict[str, dict[str, dict[str, Any]]] = {
    "fmnist": {
        "fedper": {"local_keys": "net.classifier.*", **_FMNIST_HELD_OUT},  # LeNet-5's classifier layers
        "fedrep": {
            "client": "fedrep",
            "client_args": {"head_epochs": 1},
            "local_keys": "net.classifier.*",
            **_FMNIST_HELD_OUT,
        },
        "ditto": {"client": "ditto", "client_args": {"lam": 0.1}, **_FMNIST_HELD_OUT},  # personal lr: the job's
        "finetune": {"finetune_epochs": 1, **_FMNIST_HELD_OUT},
    },
    "1kg": {
        "fedper": {"local_keys": "net.head.*"},  # SnpNet's last layer; trained by DP-SGD with the rest under DP
        "fedrep": {"client": "fedrep", "client_args": {"head_epochs": 1}, "local_keys": "net.head.*"},
        "ditto": {"client": "ditto", "client_args": {"lam": 0.1, "personal_lr": 0.01}},
        "finetune": {"finetune_epochs": 1},
    },
}
#: Personalized methods refused under DP-SGD (lightning_modules/privacy/dp_sgd.py, REFUSED, and the job checks for
#: fine-tuning): no-DP cells only.
PERSONAL_NO_DP = frozenset({"ditto", "fedrep", "finetune"})


def cell_overrides(
    method: str, epsilon: float | None, base: Mapping[str, Any], settings: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The settings of one grid cell: ``base`` (from --set), the method's (``settings`` when given, else
    `METHODS`'), and DP-SGD calibrated to ``epsilon``."""
    if settings is None and method not in METHODS:
        raise SystemExit(f"error: --methods: unknown method {method!r}; choose from {', '.join(METHODS)}")
    values = {**base, **(METHODS[method] if settings is None else settings)}
    if epsilon is not None:
        values.update(DP_SETTINGS, dp_target_epsilon=epsilon)
    return values


def run_grid(
    tasks: Sequence[str],
    methods: Sequence[str],
    epsilons: Sequence[float | None],
    seeds: Sequence[int],
    shadows: int,
    attacked: Sequence[str],
    rounds: int | None,
    base: Mapping[str, Any],
    work: Path,
    compute: bool = True,
    more_rounds: Mapping[tuple[str, str], Sequence[int]] | None = None,
    personal: Sequence[tuple[str, str, int | None]] = (),
) -> tuple[list[dict[str, Any]], list[str]]:
    """(cells, missing): every (task, method, epsilon) cell at ``rounds`` (default: the task's), and again at each
    of ``more_rounds[(task, method)]``; LiRA (``shadows`` shadow federations) only for the ``attacked`` methods, the
    loss attack for all. Each federation is cached under ``work``, so a rerun completes only what is missing; with
    ``compute`` False a cell with any federation not cached is skipped and named in ``missing``. ``personal``:
    (task, method, rounds or None) of `PERSONAL_METHODS`, run at their rounds (else ``rounds``) and every
    budget they compose with, their sites' personal models attacked too (cells marked ``personal``)."""
    cells, missing = [], []
    for name in tasks:
        task = TASKS[name]
        for method in methods:
            base_rounds = rounds or task.rounds
            extra = [r for r in (more_rounds or {}).get((name, method), ()) if r != base_rounds]
            for cell_rounds in (base_rounds, *extra):
                for epsilon in epsilons:
                    n_shadows = shadows if method in attacked else 0
                    overrides = cell_overrides(method, epsilon, base)
                    try:
                        result = measure_task(task, seeds, n_shadows, cell_rounds, overrides, work, compute)
                    except NotCached:
                        label = f"{name} {method} ε={'∞' if epsilon is None else f'{epsilon:g}'}"
                        missing.append(label if cell_rounds == base_rounds else f"{label} ({cell_rounds} rounds)")
                        continue
                    cells.append({**result, "method": method, "target_epsilon": epsilon})
    for name, method, personal_rounds in personal:
        task, settings = TASKS[name], PERSONAL_METHODS[name][method]
        cell_rounds = personal_rounds or rounds or task.rounds
        for epsilon in epsilons:
            if epsilon is not None and method in PERSONAL_NO_DP:
                continue
            overrides = cell_overrides(method, epsilon, base, settings)
            try:
                result = measure_task(task, seeds, shadows, cell_rounds, overrides, work, compute, personal=True)
            except NotCached:
                eps = "∞" if epsilon is None else f"{epsilon:g}"
                missing.append(f"{name} {method} ε={eps} ({cell_rounds} rounds, personal)")
                continue
            cells.append({**result, "method": method, "target_epsilon": epsilon, "personal": True})
    return cells, missing


def parse_personal(values: Sequence[str]) -> list[tuple[str, str, int | None]]:
    """``TASK:METHOD[=ROUNDS]`` items (``--personal``) of `PERSONAL_METHODS`: (task, method, rounds or None
    for the grid's ``--rounds``)."""
    found = []
    for value in values:
        key, has_rounds, count = value.partition("=")
        task, _, method = key.partition(":")
        rounds = int(count) if count.isdigit() else None
        if method not in PERSONAL_METHODS.get(task, {}) or (has_rounds and not rounds):
            known = [f"{t}:{m}" for t, methods in PERSONAL_METHODS.items() for m in methods]
            raise SystemExit(
                f"error: --personal takes TASK:METHOD[=ROUNDS] (ROUNDS >= 1), TASK:METHOD one of {', '.join(known)}; "
                f"got {value!r}"
            )
        found.append((task, method, rounds))
    return found


def parse_more_rounds(values: Sequence[str], tasks: Sequence[str] = tuple(TASKS)) -> dict[tuple[str, str], list[int]]:
    """``TASK:METHOD=N[,N...]`` items (``--more-rounds``): the round counts a (task, method) is also run at."""
    found: dict[tuple[str, str], list[int]] = {}
    for value in values:
        key, _, counts = value.partition("=")
        task, _, method = key.partition(":")
        try:
            numbers = [int(c) for c in counts.split(",")]
        except ValueError:
            numbers = []
        if task not in tasks or method not in METHODS or not numbers or min(numbers) < 1:
            raise SystemExit(
                f"error: --more-rounds takes TASK:METHOD=N[,N...] (tasks {', '.join(tasks)}; methods "
                f"{', '.join(METHODS)}; N >= 1), got {value!r}"
            )
        found.setdefault((task, method), []).extend(n for n in numbers if n not in found.get((task, method), []))
    return found


def _cell(values: Sequence[float | None], scale: float = 100, digits: int = 1) -> str:
    """mean ± std of the values, '-' when any is missing."""
    if not values or any(v is None for v in values):
        return "-"
    mean, std = mean_std(values)
    return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f}"


def grid_rows(cell: Mapping[str, Any]) -> str:
    """One table row: the cell's means ± stds over its target seeds."""
    rows = cell["seeds"]
    sites = [r["site_accuracy"] for r in rows]
    site_mean = [None if s is None else float(np.mean(s)) for s in sites]
    site_worst = [None if s is None else float(np.min(s)) for s in sites]
    reached = [r.get("site_epsilon") for r in rows]
    eps = "∞" if cell["target_epsilon"] is None else f"{cell['target_epsilon']:g}"
    reached_text = "-" if any(e is None for e in reached) else f"{max(reached):.2f}"

    def attack(name: str, key: str) -> str:
        return _cell([None if r[name] is None else r[name][key] for r in rows])

    return (
        f"| {cell['task']} | {cell['method']} | {cell['rounds']} | {eps} | {reached_text} | "
        f"{_cell([r['test_accuracy'] for r in rows])} | "
        f"{_cell(site_mean)} | {_cell(site_worst)} | {attack('loss', 'auc')} | {attack('loss', 'tpr@0.01')} | "
        f"{attack('lira', 'auc')} | {attack('lira', 'tpr@0.01')} |"
    )


def personal_row(cell: Mapping[str, Any]) -> str:
    """One row of the personal-model table: the cell's means ± stds over its target seeds, personal against global."""
    rows = [r["personal"] for r in cell["seeds"]]
    reached = [r.get("site_epsilon") for r in cell["seeds"]]
    eps = "∞" if cell["target_epsilon"] is None else f"{cell['target_epsilon']:g}"
    reached_text = "-" if any(e is None for e in reached) else f"{max(reached):.2f}"

    def pair(name: str, key: str | None = None) -> str:
        def get(row: Mapping[str, Any], which: str) -> float | None:
            value = row[which]
            return value if key is None or value is None else value[key]

        return f"{_cell([get(r, name) for r in rows])} | {_cell([get(r, 'global_' + name) for r in rows])}"

    return (
        f"| {cell['task']} | {cell['method']} | {cell['rounds']} | {eps} | {reached_text} | {pair('accuracy')} | "
        f"{pair('loss', 'auc')} | {pair('lira', 'auc')} | {pair('lira', 'tpr@0.01')} |"
    )


def personal_section(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """The personal-model table and how to read it (empty without personal cells)."""
    if not cells:
        return []
    return [
        "### Attacks on a site's personal model",
        "",
        "A site's personal model never leaves the site; the attack models a curious insider at the site holding it "
        "(or the model leaking from there). For site k: members are the site's training records, non-members its "
        "validation records (of its share of the same Dirichlet draw, never trained on); 'personal' scores "
        "them with site k's personal model, 'global' with the federation's final global model, so the two attack "
        "the same records. Per site, then the mean over the 3 sites; mean ± std over the target seeds. LiRA's 'out' "
        "models: the shadow federations' personal models of every site (the shadow federations run the cell's "
        "settings), 'out' for a record when that shadow federation did not train on it; the global column uses the "
        "shadows' global models. Accuracy: on the site's own validation records, mean over the sites. On "
        "Fashion-MNIST every site holds out 40 % of its shard for this (`site_val_fraction 0.4`), so its sites "
        "train on 60 % of the images of the rows above. The personal models: FedPer's and FedRep's are the global body "
        "with the site's own head (`local_keys`: LeNet-5's `net.classifier.*`, the genomics MLP's `net.head.*`; "
        "FedRep with 1 head epoch before the body's); fine-tuning's is the final global model trained 1 more epoch "
        "at the site; Ditto's is v_i (λ 0.1; personal lr 0.01 on 1kg, the job's lr on Fashion-MNIST). The global "
        "column of FedPer and FedRep carries the initial head (the server never sees the heads). Under DP-SGD "
        "FedPer's head is trained by DP-SGD with the rest, so the site's ε covers it; FedRep, fine-tuning and Ditto "
        "train on the data outside what is accounted and are refused under DP: no-DP cells only.",
        "",
        "| task | method | rounds | ε target | ε reached | acc.: personal | acc.: global | loss AUC: personal | "
        "loss AUC: global | LiRA AUC: personal | LiRA AUC: global | LiRA TPR @ 1 %: personal | "
        "LiRA TPR @ 1 %: global |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[personal_row(cell) for cell in cells],
        "",
        *personal_leak_note(cells),
    ]


def paired_verdict(personal: Sequence[float], shared: Sequence[float]) -> str:
    """``more``, ``less`` or ``tie``: the personal model's attack AUC against the global model's on the same records,
    paired by target seed; d = personal - global per seed, beyond the seed spread when |mean(d)| > std(d) (a single
    seed has no spread: any difference counts); the personalization report's rule
    (`benchmarks.personalization.verdict`)."""
    from benchmarks.personalization import verdict

    mean, std = mean_std([p - g for p, g in zip(personal, shared, strict=True)])
    return {"gain": "more", "lose": "less"}.get(verdict(mean, std), "tie")


def personal_leak_note(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per attack, the personal-model cells whose AUC is above (below) the global model's beyond the seed spread
    (`paired_verdict`); every other cell is a tie."""
    lines = []
    for attack in ("loss", "lira"):
        found: dict[str, list[str]] = {"more": [], "less": []}
        for cell in cells:
            rows = [r["personal"] for r in cell["seeds"]]
            if any(r[attack] is None or r[f"global_{attack}"] is None for r in rows):
                continue
            verdict = paired_verdict([r[attack]["auc"] for r in rows], [r[f"global_{attack}"]["auc"] for r in rows])
            if verdict in found:
                eps = "∞" if cell["target_epsilon"] is None else f"{cell['target_epsilon']:g}"
                found[verdict].append(f"{cell['task']} {cell['method']} ε={eps}")
        text = "; ".join(f"{verdict}: {', '.join(names)}" for verdict, names in found.items() if names)
        lines.append(
            f"- {ATTACK_NAMES[attack]}, personal AUC against global AUC beyond the seed spread (paired by seed): "
            + (text or "none")
            + "; every other cell a tie."
        )
    return [*lines, ""]


def no_dp_accuracy(cells: Sequence[Mapping[str, Any]], task: str, method: str = "fedavg") -> dict[int, list[float]]:
    """rounds -> the target seeds' global test accuracy of ``task``'s no-DP cell of ``method``, for every round count
    the cells hold."""
    return {
        cell["rounds"]: [r["test_accuracy"] for r in cell["seeds"]]
        for cell in cells
        if cell["task"] == task and cell["method"] == method and cell["target_epsilon"] is None
    }


def undertraining_note(
    cells: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]] = ()
) -> tuple[list[str], list[str]]:
    """(lines, undertrained tasks): per task, FedAvg's no-DP accuracy at each round count the grid ran it at, and at
    the no-DP section's (``reference``: its results, FedAvg without settings) when that count is not in the grid. A
    task is undertrained at its fewest rounds when that mean is below the mean at its most rounds by more than the
    latter's seed spread (smaller gaps are ties)."""
    lines, undertrained = [], []
    for task in dict.fromkeys(cell["task"] for cell in cells):
        points = {rounds: (values, "grid") for rounds, values in no_dp_accuracy(cells, task).items()}
        for result in reference:
            if result["task"] == task and not result["overrides"] and result["rounds"] not in points:
                points[result["rounds"]] = ([r["test_accuracy"] for r in result["seeds"]], "the section above")
        if len(points) < 2:
            continue
        fewest, most = min(points), max(points)
        (low, _), (high, spread) = mean_std(points[fewest][0]), mean_std(points[most][0])
        reached = ", ".join(
            f"{_cell(values)} % at {rounds} rounds ({source})" for rounds, (values, source) in sorted(points.items())
        )
        if high - low > spread:
            undertrained.append(task)
            verdict = (
                f"**its {fewest}-round rows are undertrained**: {100 * (high - low):.1f} points below the same "
                f"federations at {most} rounds, beyond the seed spread"
            )
        else:
            verdict = (
                f"the gap from {fewest} to {most} rounds ({100 * (high - low):.1f} points) is within the seed spread"
            )
        lines.append(f"- {task}: FedAvg without DP reaches {reached}; {verdict}.")
    if undertrained:
        advice = []
        for task in undertrained:
            most = max(no_dp_accuracy(cells, task))
            rounds_of: dict[str, set[int]] = {}
            for cell in cells:
                if cell["task"] == task:
                    rounds_of.setdefault(cell["method"], set()).add(cell["rounds"])
            short = [method for method, counts in rounds_of.items() if max(counts) < most]
            advice.append(
                f"read {task}'s trade-off from its {most}-round rows"
                + (
                    f"; its {' and '.join(short)} rows stop short of that and do not rank those methods"
                    if short
                    else ""
                )
            )
        lines += [
            "",
            "Reading an undertrained row: its models have barely left their initialisation, so its accuracy "
            "differences between budgets and between methods mostly reflect where training started, not what DP "
            "costs; and membership leaks as a model fits its training data, so its attack AUCs understate what a "
            f"trained model of the task would leak. So {'; '.join(advice)}.",
        ]
    return lines, undertrained


def grid_section(
    cells: Sequence[Mapping[str, Any]],
    command: str,
    plot: str | None,
    missing: Sequence[str] = (),
    reference: Sequence[Mapping[str, Any]] = (),
) -> list[str]:
    """The page's utility-vs-privacy section (between markers, so the no-DP section above stays); ``reference``: the
    no-DP section's results, for the undertraining note. Personal cells get a table of their own, after the grid's."""
    minutes = sum(cell["federation_minutes"] for cell in cells)
    personal = [cell for cell in cells if cell.get("personal")]
    cells = [cell for cell in cells if not cell.get("personal")]
    first = cells[0]
    counts = sorted({cell["rounds"] for cell in cells})
    more = sorted({f"{c['task']} {c['method']}" for c in cells if c["rounds"] != counts[0]})
    rounds_text = f"{counts[0]} rounds instead of 10" + (
        f" ({', '.join(more)} also at {', '.join(str(r) for r in counts[1:])}: the 'rounds' column)" if more else ""
    )
    note, _ = undertraining_note(cells, reference)
    lines = [
        GRID_BEGIN,
        "## Utility vs privacy: DP-SGD at every site",
        "",
        f"Command: `{command}` (its federations ran {minutes:.1f} min in all; a rerun reads them from `--work` and "
        "runs only the missing ones). Reduced protocol against the no-DP section above, to fit a shared 2-core CPU: "
        f"{rounds_text}, target seeds {', '.join(str(r['seed']) for r in first['seeds'])}, "
        "LiRA with "
        f"{max(c['shadows'] for c in cells)} shadow federations (trained with the cell's own settings, budget "
        "included) and only for the methods that have a LiRA column; the loss attack for every cell. Tasks, "
        "models and data as above. DP-SGD: "
        "`--dp-target-epsilon ε` (σ calibrated by each site for all the planned rounds), `--dp-max-grad-norm 1`, "
        "`--dp-delta 1e-5`, not tuned; 'ε reached' is the largest site's after the last round (from the rounds' "
        "`privacy` records). SCAFFOLD: Option II (post-processing of the DP outputs); FedAdam: the server "
        "optimizer with its defaults.",
        "",
    ]
    if note:
        lines += ["**Trained enough?** Each task's accuracy without DP against its round count:", "", *note, ""]
    lines += [
        "Accuracy is in %: 'global' on the task's test set; 'per site' is each site's accuracy estimated outside the "
        "federation by the benchmark (under DP the sites withhold their own evaluation scores by design): the final "
        "global model's per-class test accuracy weighted by the class shares of the site's training labels, then the "
        "mean and the worst of the 3 sites. Attack AUC and TPR at 1 % FPR in % (chance: 50 and 1). Every cell: mean ± "
        "std over the target seeds.",
        "",
        "| task | method | rounds | ε target | ε reached | global acc. | per site: mean | per site: worst | loss AUC | "
        "loss TPR @ 1 % | LiRA AUC | LiRA TPR @ 1 % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[grid_rows(cell) for cell in cells],
        "",
        *personal_section(personal),
    ]
    if missing:
        complete = command.replace(" --cached-only", "")
        lines += [f"Not yet run (time): {', '.join(missing)}. `{complete}` runs them and rewrites this section.", ""]
    if plot:
        lines += [f"![accuracy and attack AUC against epsilon]({plot})", ""]
    return [*lines, GRID_END]


def replace_section(text: str, section: Sequence[str]) -> str:
    """``text`` with the marked grid section replaced by ``section``, or ``section`` appended when absent."""
    block = "\n".join(section)
    if GRID_BEGIN in text and GRID_END in text:
        head, _, rest = text.partition(GRID_BEGIN)
        _, _, tail = rest.partition(GRID_END)
        return head + block + tail
    return text.rstrip("\n") + "\n\n" + block + "\n"


def epsilon_axis(epsilons: Sequence[float | None]) -> list[float]:
    """Plot positions: the budgets on a log axis, no DP (None) one factor of 2.5 past the largest budget."""
    finite = [e for e in epsilons if e is not None]
    top = 2.5 * max(finite) if finite else 1.0
    return [top if e is None else e for e in epsilons]


def plot_grid(cells: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Two panels: global test accuracy and the strongest attack's AUC, each against epsilon, a line per task and
    method (attack: the methods that were attacked with LiRA, else the loss attack)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, auc_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    groups: dict[tuple[str, str, int], list[Mapping[str, Any]]] = {}
    for cell in cells:
        groups.setdefault((cell["task"], cell["method"], cell["rounds"]), []).append(cell)
    colours = {method: f"C{i}" for i, method in enumerate(METHODS)}
    fewest = min(cell["rounds"] for cell in cells)
    for (task, method, rounds), group in groups.items():
        xs = epsilon_axis([c["target_epsilon"] for c in group])
        style = {"color": colours.get(method), "linestyle": "-" if task == "1kg" else "--"}
        style["marker"] = "o" if rounds == fewest else "s"
        style["linewidth"] = 1.5 if rounds == fewest else 2.5
        name = f"{task} {method} {rounds}r"
        acc = [mean_std([r["test_accuracy"] for r in c["seeds"]])[0] for c in group]
        acc_ax.plot(xs, acc, label=name, **style)
        attack = "lira" if all(c["seeds"][0]["lira"] is not None for c in group) else "loss"
        auc = [mean_std([r[attack]["auc"] for r in c["seeds"]])[0] for c in group]
        auc_ax.plot(xs, auc, label=f"{name} ({ATTACK_NAMES[attack]})", **style)
    ticks = sorted({x for c in cells for x in epsilon_axis([c["target_epsilon"]] + [e for e in EPSILONS if e])})
    for ax, label in ((acc_ax, "global test accuracy"), (auc_ax, "attack AUC")):
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(ticks, ["∞" if t not in EPSILONS else f"{t:g}" for t in ticks])
        ax.set_xlabel("ε (δ = 1e-5; ∞: no DP)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    auc_ax.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    acc_ax.legend(fontsize=7)
    auc_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_grid(cells: Sequence[Mapping[str, Any]], out: Path, command: str, missing: Sequence[str] = ()) -> None:
    """The grid section into the page ``out`` (kept around it), its JSON and plot beside it as ``<stem>_dp.*``."""
    plot = out.with_name(out.stem + "_dp.png")
    plot_grid([cell for cell in cells if not cell.get("personal")], plot)
    text = out.read_text() if out.exists() else "# Membership inference against the final global model\n"
    no_dp = out.with_suffix(".json")  # the no-DP section's results, when the page has one
    reference = json.loads(no_dp.read_text()) if no_dp.exists() else []
    out.write_text(replace_section(text, grid_section(cells, command, plot.name, missing, reference)))
    out.with_name(out.stem + "_dp.json").write_text(json.dumps(cells, indent=1) + "\n")


def parse_epsilons(values: Sequence[str]) -> list[float | None]:
    """Budgets from the command line: numbers > 0, or 'inf' for no DP."""
    epsilons: list[float | None] = []
    for value in values:
        if value.lower() in ("inf", "none"):
            epsilons.append(None)
            continue
        try:
            epsilon = float(value)
        except ValueError:
            epsilon = -1.0
        if not (epsilon > 0 and math.isfinite(epsilon)):
            raise SystemExit(f"error: --epsilons takes numbers > 0 or 'inf' (no DP), got {value!r}")
        epsilons.append(epsilon)
    return epsilons


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(TARGET_SEEDS))
    parser.add_argument("--shadows", type=int, default=8, help="shadow federations per task (shared by the seeds)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every federation (default: the task's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--work", type=Path, default=Path("runs/privacy"), help="cached scores of every federation")
    parser.add_argument("--out", type=Path, default=None, help="write the page here (and its JSON beside it)")
    parser.add_argument("--threads", type=int, default=1)
    grid = parser.add_argument_group("utility vs privacy (--grid): methods x DP-SGD budgets")
    grid.add_argument("--grid", action="store_true", help="run every (task, method, epsilon) cell")
    grid.add_argument("--methods", nargs="+", default=list(METHODS), help=f"of {', '.join(METHODS)}")
    grid.add_argument("--epsilons", nargs="+", default=["1", "3", "8", "inf"], help="budgets; 'inf': no DP")
    grid.add_argument("--attacked", nargs="*", default=["fedavg"], help="methods attacked with LiRA too")
    grid.add_argument("--cached-only", action="store_true", help="write the cells already in --work, run nothing")
    grid.add_argument(
        "--more-rounds",
        nargs="*",
        default=[],
        metavar="TASK:METHOD=N",
        help="also run that task's method (every budget) at N rounds, e.g. fmnist:fedavg=10",
    )
    grid.add_argument(
        "--personal",
        nargs="*",
        default=[],
        metavar="TASK:METHOD[=N]",
        help="also attack the sites' personal models of these personalized federations (LiRA with --shadows), at N "
        "rounds (default: --rounds), e.g. 1kg:fedper fmnist:fedrep=10; every budget the method composes with "
        "(FedRep, Ditto and fine-tuning: no DP)",
    )
    args = parser.parse_args(argv)
    if args.shadows < 1 and not (args.grid and not args.attacked):
        raise SystemExit("error: --shadows must be at least 1 (LiRA needs shadow models)")
    import torch

    torch.set_num_threads(args.threads)
    overrides = parse_overrides(args.overrides)
    command = "python -m benchmarks.privacy " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.grid:
        epsilons = parse_epsilons(args.epsilons)
        cells, missing = run_grid(
            args.tasks,
            args.methods,
            epsilons,
            args.seeds,
            args.shadows,
            args.attacked,
            args.rounds,
            overrides,
            args.work,
            compute=not args.cached_only,
            more_rounds=parse_more_rounds(args.more_rounds),
            personal=parse_personal(args.personal),
        )
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_grid(cells, args.out, command, missing)
        print(json.dumps(cells, indent=1))
        return 0
    results = [
        measure_task(TASKS[name], args.seeds, args.shadows, args.rounds or TASKS[name].rounds, overrides, args.work)
        for name in args.tasks
    ]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_page(results, args.out, command)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
