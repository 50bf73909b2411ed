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
import logging
from collections.abc import Sequence

import numpy as np

LOG = logging.getLogger("fedalg.client")


def build_parser() -> argparse.ArgumentParser:
    """The client options, from the one declaration of every setting (``jobs/settings.py``): the job's client-side
    settings plus the site's own (data folder, accelerator). Values are checked as the builder checks them, so a
    hand-written command line is refused with the same one-line messages."""
    from jobs.settings import CLIENT, JOB_GROUPS, SITE, ClientArgumentParser, SiteSettings, add_arguments

    parser = ClientArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, (*JOB_GROUPS, SiteSettings), sides=(CLIENT, SITE), json_as_text=True)
    return parser


def log_round_metrics(tracker: object, meta: dict, round_num: int) -> None:
    """Send the round's training loss and accuracy to the server (TensorBoard event files, one folder per site)."""
    from aggregators import meta_keys

    for tag, key in (("train_loss", meta_keys.TRAIN_LOSS), ("train_accuracy", meta_keys.TRAIN_ACCURACY)):
        value = meta.get(key)
        if value is not None:
            tracker.add_scalar(tag, float(value), global_step=round_num)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.script is not None:  # the user's own training script, shipped beside this one
        from lightning_modules.own_model import run_user_script

        run_user_script(args, __file__)
        return
    if args.model is not None:  # the user's own LightningModule and data module (lightning_modules/own_model.py)
        from lightning_modules.own_model import run_site

        run_site(args)
        return
    import nvflare.client.lightning as flare
    from nvflare.client.tracking import SummaryWriter

    from aggregators import meta_keys
    from data_prep import SiteDataConfig
    from data_prep.site_config import resolve_site_data, seed_index, site_workspace
    from jobs.settings import dataset_num_classes
    from lightning_modules.site import build_site_round
    from lightning_modules.state_store import ClientStateStore, default_state_root

    flare.init()
    site = flare.get_site_name()
    tracker = SummaryWriter()
    num_classes = dataset_num_classes(args.dataset)
    # Real sites read their own data (site env var or local/ config); only the simulator derives shards from the job.
    data = resolve_site_data(site, site_workspace(), SiteDataConfig.from_namespace(args), num_classes)
    print(f"{site}: training data from {data.source}")
    # The round itself is lightning_modules/site.py's, shared with the in-process runner (same bits, tested): the
    # built-in classifier with the client algorithm's callback (and a malicious site's attack, for robustness
    # experiments). State that must outlive a round lives on disk in the site workspace, per federated run.
    store = ClientStateStore(default_state_root(), site, per_run=True)  # <root>/<run id>/<site>/: survives resume
    index = seed_index(site, args.num_sites)
    site_round = build_site_round(args, site, index, data.x, data.y, num_classes, store)
    counts = np.bincount(data.y, minlength=num_classes).tolist()
    print(f"{site}: {len(data.y)} training samples, label counts {counts}")
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
