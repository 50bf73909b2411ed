"""Pretrain the attack-adaptive attention network on captured rounds (the "capture -> pretrain -> rerun" workflow).

    python -m aggregators.pretrain_attention --dataset-dir CAPTURE_DIR --save-path attention.pt

Reference: Wan & Chen, FTL-IJCAI'21, arXiv:2102.05257 (docs/robustness.md, attack-adaptive aggregation, "Pretraining").
Every captured round is
one sample: the clients' projections P (n, C) and the benign/malicious labels. The network runs exactly the
aggregation-time attention (aggregators/attention.py: median query, loops, scale, hard threshold, L1
renormalisation) and is trained with Adam to minimise the L1 distance between the final query sum_j w_j P_j and the
benign centroid c = mean of the benign clients' projections.

Decisions (docs/robustness.md): each sample is divided by the mean norm of its client rows, so early rounds with
large updates do not dominate the loss (the attention weights are invariant to that scale: phi has no bias and the
scores are cosines); rounds without a benign client are skipped; batches hold rounds with the same n; the client
order is not permuted (the attention is permutation-equivariant, so a permutation would change nothing). The
checkpoint with the lowest validation loss is saved, with the layer shapes and PCA size of the capture, so the
rule can refuse it for another model.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from aggregators.attention import AttentionNet, attention_weights, median_query, save_attention_checkpoint
from aggregators.capture import CapturedRound, read_capture

Sample = tuple[torch.Tensor, torch.Tensor]  # (projections (n, C), benign centroid (C,))


def make_samples(rounds: Sequence[CapturedRound]) -> list[Sample]:
    """(P / s, c / s) per round with at least one benign client; s = mean client-row norm of P."""
    samples = []
    for record in rounds:
        benign = ~record.malicious
        if not benign.any():
            continue
        projections = torch.from_numpy(np.asarray(record.projections, np.float32))
        scale = projections.norm(dim=1).mean().clamp_min(1e-12)
        centroid = projections[torch.from_numpy(benign)].mean(dim=0)
        samples.append((projections / scale, centroid / scale))
    return samples


def batches(samples: Sequence[Sample], batch_size: int, rng: np.random.Generator | None) -> list[Sample]:
    """Stacked batches of samples with the same number of clients (shuffled when ``rng`` is given)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for index, (projections, _) in enumerate(samples):
        groups[projections.shape[0]].append(index)
    out = []
    for indices in groups.values():
        order = rng.permutation(indices).tolist() if rng is not None else indices
        for start in range(0, len(order), batch_size):
            chunk = [samples[i] for i in order[start : start + batch_size]]
            out.append((torch.stack([p for p, _ in chunk]), torch.stack([c for _, c in chunk])))
    if rng is not None:
        out = [out[i] for i in rng.permutation(len(out))]
    return out


def l1_loss(net: AttentionNet, batch: Sample, args: argparse.Namespace) -> torch.Tensor:
    projections, centroid = batch
    _, final = attention_weights(net, projections, loops=args.attention_loops, scale=args.scale, threshold=args.epsilon)
    return (final - centroid).abs().mean()


def mean_loss(net: AttentionNet, data: list[Sample], args: argparse.Namespace) -> float:
    if not data:
        return float("nan")
    with torch.no_grad():
        total = sum(l1_loss(net, batch, args).item() * len(batch[0]) for batch in data)
    return total / sum(len(batch[0]) for batch in data)


def baseline_losses(data: list[Sample]) -> dict[str, float]:
    """L1 to the benign centroid of the plain mean and of the median query: what the network must beat."""
    if not data:
        return {}
    count = sum(len(p) for p, _ in data)
    mean = sum((p.mean(dim=1) - c).abs().mean().item() * len(p) for p, c in data) / count
    median = sum((median_query(p) - c).abs().mean().item() * len(p) for p, c in data) / count
    return {"mean": mean, "median": median}


def split(samples: list[Sample], val_ratio: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    order = np.random.default_rng(seed).permutation(len(samples))
    num_val = math.floor(val_ratio * len(samples) + 0.5) if len(samples) > 1 else 0
    return [samples[i] for i in order[num_val:]], [samples[i] for i in order[:num_val]]


def train(args: argparse.Namespace) -> dict[str, float]:
    metadata, rounds = read_capture(args.dataset_dir)
    samples = make_samples(rounds)
    if not samples:
        raise SystemExit(f"error: no captured round with a benign client under {args.dataset_dir}")
    train_set, val_set = split(samples, args.val_ratio, args.seed)
    torch.manual_seed(args.seed)
    net = AttentionNet(int(metadata["input_width"]), args.hidden_size)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.learning_rate)
    rng = np.random.default_rng(args.seed)
    val_batches = batches(val_set, args.batch_size, None)
    monitor = val_batches or batches(train_set, args.batch_size, None)
    print(
        f"{len(rounds)} rounds from {len(metadata['runs'])} run(s): {len(train_set)} train / {len(val_set)} val "
        f"samples, C={metadata['input_width']}; baselines (val L1): {baseline_losses(monitor)}",
        file=sys.stderr,
    )
    best = {"epoch": -1, "val_loss": float("inf"), "train_loss": float("nan")}
    progress = tqdm(range(1, args.epochs + 1), desc="pretrain attention", unit="epoch", file=sys.stderr)
    for epoch in progress:
        losses = []
        for batch in batches(train_set, args.batch_size, rng):
            optimizer.zero_grad()
            loss = l1_loss(net, batch, args)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        train_loss, val_loss = float(np.mean(losses)), mean_loss(net, monitor, args)
        progress.set_postfix(train=f"{train_loss:.4f}", val=f"{val_loss:.4f}")
        tqdm.write(f"epoch {epoch}: train L1 {train_loss:.5f}  val L1 {val_loss:.5f}", file=sys.stderr)
        if val_loss < best["val_loss"]:
            best = {"epoch": epoch, "val_loss": val_loss, "train_loss": train_loss}
            save_checkpoint(net, metadata, args, best, len(train_set), len(val_set))
    return best


def save_checkpoint(net, metadata, args, best, num_train, num_val) -> None:
    save_attention_checkpoint(
        args.save_path,
        net,
        pca_components=int(metadata["pca_components"]),
        layer_shapes=metadata["layer_shapes"],
        best_epoch=int(best["epoch"]),
        val_l1=float(best["val_loss"]),
        train_l1=float(best["train_loss"]),
        train_samples=num_train,
        val_samples=num_val,
        epsilon=float(args.epsilon),
        scale=float(args.scale),
        attention_loops=int(args.attention_loops),
        learning_rate=float(args.learning_rate),
        batch_size=int(args.batch_size),
        seed=int(args.seed),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aggregators.pretrain_attention", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dataset-dir", type=Path, required=True, help="a capture run folder or a folder of runs")
    parser.add_argument("--save-path", type=Path, required=True, help="where the best checkpoint is written")
    parser.add_argument("--epochs", type=int, default=100, help="passes over the training rounds (default: 100)")
    parser.add_argument("--batch-size", type=int, default=16, help="rounds per Adam step (default: 16)")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="Adam learning rate (default: 1e-4)")
    parser.add_argument("--val-ratio", type=float, default=0.1, help="share of rounds held out (default: 0.1)")
    parser.add_argument("--epsilon", type=float, default=0.005, help="hard attention threshold (default: 0.005)")
    parser.add_argument("--scale", type=float, default=10.0, help="attention scaling factor (default: 10)")
    parser.add_argument("--attention-loops", type=int, default=5, help="attention iterations (default: 5)")
    parser.add_argument("--hidden-size", type=int, default=32, help="attention output width H (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the split, the init and the batch order")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.val_ratio < 1:
        raise SystemExit(f"error: --val-ratio must be in [0, 1), got {args.val_ratio}")
    torch.set_num_threads(1)  # the network is tiny: more threads only add contention
    started = time.monotonic()
    best = train(args)
    print(
        f"best epoch {best['epoch']}: val L1 {best['val_loss']:.5f} (train {best['train_loss']:.5f}); "
        f"saved {args.save_path} in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
