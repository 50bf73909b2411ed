"""Driver for ``test_lm_ddp.py``: a small federation run in process, every site training with ``--devices``
processes (Lightning DDP on CPU when started by torchrun). Rank 0 writes the final global model and every site's
algorithm state to ``--out``.

    python tests/lightning_modules/ddp_site_rounds.py --devices 1 --out one.pt --state-dir s1
    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/lightning_modules/ddp_site_rounds.py --devices 2 --out two.pt --state-dir s2

Under DDP, Lightning shuffles the training data with a ``DistributedSampler`` seeded from ``PL_GLOBAL_SEED`` (which
the site sets per round): rank r takes positions r, r + 2, ... of one seeded permutation. With a per-process batch
of ``GLOBAL_BATCH / devices``, step k of the two ranks together covers positions 16k .. 16k + 15 of that
permutation, so the single-process run samples the same permutation in order with the global batch; DDP's averaged
gradient is then the single-process gradient.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

GLOBAL_BATCH = 16
#: client -> (server rule, client args)
CASES = {
    "fedavg": ("fedavg", {}),
    "scaffold": ("scaffold", {}),
    "fedprox": ("fedavg", {"mu": 0.1}),
    "feddyn": ("feddyn", {}),
}


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.body(x), y)

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
        # What DistributedSampler draws in epoch 0: randperm seeded with seed + epoch.
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(int(os.environ["PL_GLOBAL_SEED"])))
        return DataLoader(data, batch_size=GLOBAL_BATCH, sampler=order.tolist())


def run(client: str, devices: int, state_root: Path) -> dict:
    from controllers.in_process import quiet_lightning, run_in_process
    from jobs.spec import JobSpec
    from lightning_modules.state_store import ClientStateStore

    server, client_args = CASES[client]
    spec = JobSpec(
        name=f"ddp_{client}",
        model="ddp_site_rounds:TinyModule",
        data="ddp_site_rounds:TinyData",
        data_args={"devices": devices},
        client=client,
        client_args=client_args,
        server=server,
        num_sites=2,
        num_rounds=3,
        devices=devices,
    )
    with quiet_lightning():
        result = run_in_process(spec, state_root, run_id="ddp")
    states = {}
    for site in ("site-1", "site-2"):
        stored = ClientStateStore(state_root, site).latest(client) if client != "fedavg" else None
        states[site] = stored.state if stored is not None else {}
    return {"params": result.params, "states": states, "losses": [r.get("site_train_loss") for r in result.records]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, required=True, help="shared by the ranks, as a site workspace is")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lightning_modules.distributed import close_site_processes

    results = {client: run(client, args.devices, args.state_dir / client) for client in CASES}
    rank = int(os.environ.get("RANK", "0"))
    torch.save(results, args.out if rank == 0 else args.out.with_suffix(f".rank{rank}.pt"))
    close_site_processes()  # as the client script does: a rank exiting with live gloo threads can abort


if __name__ == "__main__":
    main()
