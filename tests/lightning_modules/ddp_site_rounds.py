"""Driver for ``test_lm_ddp.py``: a small federation run in process, every site training with ``--devices``
processes (Lightning DDP on CPU when started by torchrun). Rank 0 writes the final global model and every site's
algorithm state to ``--out``.

    python tests/lightning_modules/ddp_site_rounds.py --devices 1 --out one.pt --state-dir s1
    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/lightning_modules/ddp_site_rounds.py --devices 2 --out two.pt --state-dir s2

Under DDP, Lightning shuffles the training data with a ``DistributedSampler`` seeded from ``PL_GLOBAL_SEED`` (which
the site sets per round): rank r takes positions r, r + 2, ... of one seeded permutation. With a per-process batch
of ``GLOBAL_BATCH / devices``, step k of the two ranks together covers positions 16k .. 16k + 15 of that
permutation, so the single-process run samples the same permutation in order with the global batch (a one-replica
``DistributedSampler``, so that later epochs, FedRep's body phase, reshuffle as DDP's do); DDP's averaged gradient
is then the single-process gradient.

Besides the models and states, every case returns what each site sent (the entry names), the rounds' records and
the state files this process wrote, so the test can check that the local entries never travel and that rank 1
writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

GLOBAL_BATCH = 16
#: The classifier head of `TinyModule`: FedPer's local entries, FedRep's head.
HEAD = "body.2.*"
#: case -> (client algorithm, server rule, client args, local keys)
CASES = {
    "fedavg": ("fedavg", "fedavg", {}, ""),
    "scaffold": ("scaffold", "scaffold", {}, ""),
    "fedprox": ("fedprox", "fedavg", {"mu": 0.1}, ""),
    "feddyn": ("feddyn", "feddyn", {}, ""),
    "fedper": ("fedavg", "fedavg", {}, HEAD),
    "fedrep": ("fedrep", "fedavg", {"head_epochs": 1}, HEAD),
    "fedbn": ("fedavg", "fedavg", {}, "batchnorm"),  # TinyModule(batchnorm=True)
}


class TinyModule(pl.LightningModule):
    """Linear, ReLU, Linear (the head, ``body.2``); with ``batchnorm`` a BatchNorm1d after the first Linear."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            norm = [torch.nn.BatchNorm1d(16)] if batchnorm else []
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), *norm, torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.body(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.body(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TinyData(pl.LightningDataModule):
    def __init__(self, site: str = "site-1", devices: int = 1) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(int(site.rsplit("-", 1)[-1]))
        self.x = torch.randn(64, 8, generator=generator)
        self.y = torch.randint(0, 3, (64,), generator=generator)
        self.devices = devices

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(self.x, self.y)
        if self.devices > 1:  # Lightning swaps in its DistributedSampler
            return DataLoader(data, batch_size=GLOBAL_BATCH // self.devices, shuffle=True)
        # What Lightning's DistributedSampler draws on every rank: randperm seeded with seed + epoch (Lightning calls
        # set_epoch), here for one replica taking the whole permutation.
        seed = int(os.environ["PL_GLOBAL_SEED"])
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=seed)
        return DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler)


class TinyValData(TinyData):
    """:class:`TinyData` and the validation split every personal method needs (FedPer, FedRep, FedBN), drawn after
    the training data, which stays what it was; the other cases go without, as validating costs every round."""

    def __init__(self, site: str = "site-1", devices: int = 1) -> None:
        super().__init__(site, devices)
        generator = torch.Generator().manual_seed(100 + int(site.rsplit("-", 1)[-1]))
        self.val = TensorDataset(
            torch.randn(16, 8, generator=generator), torch.randint(0, 3, (16,), generator=generator)
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=GLOBAL_BATCH)


def run(case: str, devices: int, state_root: Path) -> dict:
    from benchmarks.in_process import initial_params, quiet_lightning, run_in_process
    from jobs.spec import JobSpec
    from lightning_modules import state_store
    from lightning_modules.personalization.partial_sharing import STORE_NAME

    client, server, client_args, local_keys = CASES[case]
    spec = JobSpec(
        name=f"ddp_{case}",
        model="ddp_site_rounds:TinyModule",
        model_args={"batchnorm": True} if local_keys == "batchnorm" else {},
        data="ddp_site_rounds:TinyValData" if local_keys else "ddp_site_rounds:TinyData",
        data_args={"devices": devices},
        client=client,
        client_args=client_args,
        server=server,
        local_keys=local_keys,
        num_sites=2,
        num_rounds=3,
        devices=devices,
    )
    sent: list[tuple[int, str, list[str]]] = []
    written: list[str] = []
    write = state_store.atomic_write_bytes

    def recording_write(target: Path, data: bytes) -> None:
        written.append(str(Path(target).relative_to(state_root)))
        write(target, data)

    state_store.atomic_write_bytes = recording_write
    try:
        with quiet_lightning():
            result = run_in_process(
                spec, state_root, run_id="ddp", wrap_transport=lambda inner: RecordingTransport(inner, sent)
            )
    finally:
        state_store.atomic_write_bytes = write
    store_name = STORE_NAME if local_keys else client  # FedPer's and FedRep's state: the local entries
    states = {}
    for site in ("site-1", "site-2"):
        stored = state_store.ClientStateStore(state_root, site).latest(store_name) if store_name != "fedavg" else None
        states[site] = stored.state if stored is not None else {}
    return {
        "params": result.params,
        "initial": initial_params(spec),
        "local_keys": spec.local_keys.split(",") if spec.local_keys else [],
        "states": states,
        "losses": [r.get("site_train_loss") for r in result.records],
        "rounds": [(r["status"], list(r["aggregated"])) for r in result.rounds],
        # Every round's validation scores per site: the global model's, and FedPer's, FedBN's, FedRep's personal one.
        "site_eval": [
            {metric: summary["per_site"] for metric, summary in r.get("site_eval", {}).items()} for r in result.rounds
        ],
        "sent": sent,
        "written": written,
    }


class RecordingTransport:
    """The in-process transport, noting the entry names every site sends each round."""

    def __init__(self, inner, sent: list) -> None:
        self.inner, self.sent = inner, sent

    def train(self, round_num, targets, params, meta):
        results = self.inner.train(round_num, targets, params, meta)
        self.sent += [(round_num, result.site, sorted(result.params)) for result in results]
        return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, required=True, help="shared by the ranks, as a site workspace is")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases to run (default: all)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lightning_modules.distributed import close_site_processes

    results = {case: run(case, args.devices, args.state_dir / case) for case in args.cases.split(",")}
    rank = int(os.environ.get("RANK", "0"))
    torch.save(results, args.out if rank == 0 else args.out.with_suffix(f".rank{rank}.pt"))
    close_site_processes()  # as the client script does: a rank exiting with live gloo threads can abort


if __name__ == "__main__":
    main()
