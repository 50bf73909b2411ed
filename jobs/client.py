"""The one NVFlare client script of the bundle (runs on every site, copied into each job's ``custom/``).

Per round: receive the global model (NVFlare's FLCallback loads it into the module), train locally with
Lightning under the configured client algorithm, send the weights back with namespaced meta
(``train.num_samples`` is the FedAvg weight), and stream the round's training loss/accuracy to the server's
TensorBoard receiver. In simulation each site derives its own shard of the dataset from its site name
(``site-1`` ... ``site-N``) and the job's data settings; a provisioned site reads its own data, configured on the
site (``$FEDALG_SITE_DATA`` or ``local/fedalg_site_data.json``, see ``data_prep/site_config.py``).

Runs as ``python client.py --help`` outside NVFlare too, to show the options.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence

import numpy as np

from data_prep import DATASETS, SCHEMES
from lightning_modules.attacks import add_attack_arguments

LOG = logging.getLogger("fedalg.client")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    data = parser.add_argument_group(
        "data (simulation: every site derives its shard from these; provisioned sites use their own data)"
    )
    data.add_argument("--dataset", default="fashion_mnist", choices=DATASETS)
    data.add_argument("--data-dir", default=None, help="directory with the dataset files (default: where installed)")
    data.add_argument("--scheme", default="dirichlet", choices=SCHEMES, help="how labels are split across sites")
    data.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (dirichlet, quantity)")
    data.add_argument("--classes-per-site", type=int, default=2, help="labels per site for the 'shards' scheme")
    data.add_argument("--num-sites", type=int, default=3, help="number of sites the dataset is split into")
    data.add_argument("--max-train-samples", type=int, default=None, help="use a seeded subset (fast runs)")
    data.add_argument("--seed", type=int, default=0, help="seeds the split, the model init and the shuffling")
    train = parser.add_argument_group("local training")
    train.add_argument("--arch", default="lenet5", help="model name: lenet5, simple_cnn, mlp")
    train.add_argument("--arch-args", default="{}", help="JSON object of model arguments (e.g. MOON's projection_dim)")
    train.add_argument("--epochs", type=int, default=1, help="local epochs per round (pattern 'constant')")
    train.add_argument(
        "--pattern",
        default="constant",
        choices=("constant", "uniform_random"),
        help="local epochs per round: constant (--epochs) or uniform_random (a seeded draw from "
        "[2, --max-local-epochs] per site and round, FedNova's heterogeneous local work)",
    )
    train.add_argument("--max-local-epochs", type=int, default=10, help="upper bound (inclusive) for uniform_random")
    train.add_argument("--batch-size", type=int, default=64)
    train.add_argument("--lr", type=float, default=0.05)
    train.add_argument("--momentum", type=float, default=0.0)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--precision", default="32-true", help="Lightning precision: 32-true or bf16-mixed")
    train.add_argument("--accelerator", default="auto", help="Lightning accelerator: auto, cpu, gpu")
    own = parser.add_argument_group("your own model and data (docs/own_model.md)")
    own.add_argument("--model", default=None, help="your LightningModule, 'package.module:Class'")
    own.add_argument("--model-args", default="{}", help="JSON object of your model's constructor arguments")
    own.add_argument("--data", default=None, help="your LightningDataModule, 'package.module:Class'")
    own.add_argument("--data-args", default="{}", help="JSON object of your data module's constructor arguments")
    algo = parser.add_argument_group("client algorithm")
    algo.add_argument("--client", default="fedavg", help="client algorithm name")
    algo.add_argument("--client-args", default="{}", help="JSON object of the client algorithm's hyperparameters")
    add_attack_arguments(parser)
    return parser


def round_seed(seed: int, site_index: int, round_num: int) -> int:
    """One seed per (job seed, site, round): reruns and single-/multi-process simulations shuffle identically."""
    return int(np.random.SeedSequence([seed, site_index, round_num]).generate_state(1)[0])


def local_epochs(args: argparse.Namespace, site_index: int, round_num: int) -> int:
    """This site's local epochs this round: ``--epochs``, or for ``uniform_random`` a draw from
    [2, ``--max-local-epochs``] (both inclusive) seeded by (job seed, site, round), so reruns repeat it."""
    if args.pattern == "constant":
        return args.epochs
    rng = np.random.default_rng([args.seed, site_index, round_num, 1])  # 1: a stream apart from round_seed's
    return int(rng.integers(2, args.max_local_epochs, endpoint=True))


def make_trainer(
    args: argparse.Namespace, round_callback: object, epochs: int | None = None, extra_callbacks: Sequence = ()
) -> object:
    """A fresh Trainer for every round: a Trainer reused across fits carries loop state that changes the batch
    order of later rounds, so a site that keeps its process (``-t N``) would train differently from one that is
    restarted every round (``-t 1``). Fresh trainers make both bit-identical (tested end to end)."""
    import pytorch_lightning as pl

    return pl.Trainer(
        max_epochs=epochs or args.epochs,
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        callbacks=[round_callback, *extra_callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def log_round_metrics(tracker: object, meta: dict, round_num: int) -> None:
    """Send the round's training loss and accuracy to the server (TensorBoard event files, one folder per site)."""
    from aggregators import meta_keys

    for tag, key in (("train_loss", meta_keys.TRAIN_LOSS), ("train_accuracy", meta_keys.TRAIN_ACCURACY)):
        value = meta.get(key)
        if value is not None:
            tracker.add_scalar(tag, float(value), global_step=round_num)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.model is not None:  # the user's own LightningModule and data module (lightning_modules/own_model.py)
        from lightning_modules.own_model import run_site

        run_site(args)
        return
    import nvflare.client.lightning as flare
    from nvflare.client.tracking import SummaryWriter

    from aggregators import meta_keys
    from data_prep import SiteDataConfig, to_tensor_dataset
    from data_prep.site_config import resolve_site_data, seed_index, site_workspace
    from jobs.build import dataset_num_classes
    from lightning_modules import FederatedRoundCallback, FLClassifier
    from lightning_modules.algorithms import build_client_algorithm
    from lightning_modules.attacks import AttackCallback, attack_config_from_args
    from lightning_modules.state_store import ClientStateStore, default_state_root

    flare.init()
    site = flare.get_site_name()
    tracker = SummaryWriter()
    num_classes = dataset_num_classes(args.dataset)
    # Real sites read their own data (site env var or local/ config); only the simulator derives shards from the job.
    data = resolve_site_data(site, site_workspace(), SiteDataConfig.from_namespace(args), num_classes)
    x, y = data.x, data.y
    index = seed_index(site, args.num_sites)
    dataset = to_tensor_dataset(x, y)
    print(f"{site}: training data from {data.source}")
    module = FLClassifier(
        arch=args.arch,
        num_classes=num_classes,
        arch_args=json.loads(args.arch_args),
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
    )
    algorithm = build_client_algorithm(args.client, **json.loads(args.client_args))
    # State that must outlive a round lives on disk in the site workspace, per job (DESIGN.md, decision 4).
    algorithm.bind(site, ClientStateStore(default_state_root() / flare.get_job_id(), site))
    module.set_algorithm(algorithm)
    round_callback = FederatedRoundCallback(num_samples=len(dataset), site=site)
    # Robustness experiments: a malicious site alters its update (callback) or trains on flipped labels.
    attack = attack_config_from_args(args, num_classes)
    attack_callback = AttackCallback(attack, site, index)
    print(f"{site}: {len(dataset)} training samples, label counts {np.bincount(y, minlength=num_classes).tolist()}")
    # The round itself is lightning_modules/site.py's, shared with the in-process runner (same bits, tested).
    from lightning_modules.site import LocalTraining, SiteRound

    site_round = SiteRound(
        site, index, module, x, y, LocalTraining.from_namespace(args), round_callback, attack_callback, dataset
    )
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        round_num = received.current_round or 0
        # restore_state=False: FedAvg-family clients start every round with a fresh optimizer (as FedAvg specifies),
        # and in-memory optimizer state would differ between one-process and process-per-round simulations.
        meta = site_round.fit(round_num, lambda trainer: flare.patch(trainer, restore_state=False))
        log_round_metrics(tracker, meta, round_num)
        print(
            f"{site} round {received.current_round}: {meta.get(meta_keys.NUM_STEPS)} steps, "
            f"train loss {meta.get(meta_keys.TRAIN_LOSS):.4f}, train acc {meta.get(meta_keys.TRAIN_ACCURACY):.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
