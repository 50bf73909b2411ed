"""The one NVFlare client script of the bundle (runs on every site, copied into each job's ``custom/``).

Per round: receive the global model (NVFlare's FLCallback loads it into the module), train locally with
Lightning under the configured client algorithm, send the weights back with namespaced meta
(``train.num_samples`` is the FedAvg weight). In simulation each site derives its own shard of the dataset from
its site name (``site-1`` ... ``site-N``) and the job's data settings.

Runs as ``python client.py --help`` outside NVFlare too, to show the options.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence

import numpy as np
import torch

from data_prep import DATASETS, SCHEMES

LOG = logging.getLogger("fedalg.client")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    data = parser.add_argument_group("data (simulation: every site derives its shard from these)")
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
    train.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    train.add_argument("--batch-size", type=int, default=64)
    train.add_argument("--lr", type=float, default=0.05)
    train.add_argument("--momentum", type=float, default=0.0)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--precision", default="32-true", help="Lightning precision: 32-true or bf16-mixed")
    train.add_argument("--accelerator", default="auto", help="Lightning accelerator: auto, cpu, gpu")
    algo = parser.add_argument_group("client algorithm")
    algo.add_argument("--client", default="fedavg", help="client algorithm name")
    algo.add_argument("--client-args", default="{}", help="JSON object of the client algorithm's hyperparameters")
    return parser


def round_seed(seed: int, site_index: int, round_num: int) -> int:
    """One seed per (job seed, site, round): reruns and single-/multi-process simulations shuffle identically."""
    return int(np.random.SeedSequence([seed, site_index, round_num]).generate_state(1)[0])


def make_trainer(args: argparse.Namespace, round_callback: object) -> object:
    """A fresh Trainer for every round: a Trainer reused across fits carries loop state that changes the batch
    order of later rounds, so a site that keeps its process (``-t N``) would train differently from one that is
    restarted every round (``-t 1``). Fresh trainers make both bit-identical (tested end to end)."""
    import pytorch_lightning as pl

    return pl.Trainer(
        max_epochs=args.epochs,
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        callbacks=[round_callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import nvflare.client.lightning as flare

    from aggregators import meta_keys
    from data_prep import SiteDataConfig, load_dataset, site_index, site_split, to_tensor_dataset
    from lightning_modules import FederatedRoundCallback, FLClassifier
    from lightning_modules.algorithms import build_client_algorithm
    from lightning_modules.state_store import ClientStateStore, default_state_root

    flare.init()
    site = flare.get_site_name()
    config = SiteDataConfig.from_namespace(args)
    index = site_index(site, args.num_sites)
    x, y = site_split(config, site)
    dataset = to_tensor_dataset(x, y)
    num_classes = load_dataset(args.dataset, args.data_dir).num_classes
    module = FLClassifier(
        arch=args.arch, num_classes=num_classes, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    algorithm = build_client_algorithm(args.client, **json.loads(args.client_args))
    # State that must outlive a round lives on disk in the site workspace, per job (DESIGN.md, decision 4).
    algorithm.bind(site, ClientStateStore(default_state_root() / flare.get_job_id(), site))
    module.set_algorithm(algorithm)
    round_callback = FederatedRoundCallback(num_samples=len(dataset), site=site)
    print(f"{site}: {len(dataset)} training samples, label counts {np.bincount(y, minlength=num_classes).tolist()}")
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        seed = round_seed(args.seed, index, received.current_round or 0)
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, generator=generator)
        trainer = make_trainer(args, round_callback)
        # restore_state=False: FedAvg-family clients start every round with a fresh optimizer (ALGORITHMS.md §2),
        # and in-memory optimizer state would differ between one-process and process-per-round simulations.
        flare.patch(trainer, restore_state=False)
        trainer.fit(module, train_dataloaders=loader)
        meta = round_callback.last_meta
        print(
            f"{site} round {received.current_round}: {meta.get(meta_keys.NUM_STEPS)} steps, "
            f"train loss {meta.get(meta_keys.TRAIN_LOSS):.4f}, train acc {meta.get(meta_keys.TRAIN_ACCURACY):.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
