"""Summaries of a partition: per-site label counts, a printable table, and a sites x classes heatmap."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.optional import require

__all__ = ["format_counts_table", "label_counts", "save_counts_heatmap"]

# Beyond this many cells the numbers overlap and hide the colours, so they are left out.
_MAX_ANNOTATED_CELLS = 400


def label_counts(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """Return an int64 ``(num_sites, num_classes)`` matrix: row ``s`` counts the labels of site ``s``'s indices."""
    labels = np.asarray(labels)
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataPrepError(f"labels must lie in [0, {num_classes}), got range [{labels.min()}, {labels.max()}]")
    rows = [np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes) for part in parts]
    return np.array(rows, dtype=np.int64).reshape(len(parts), num_classes)


def format_counts_table(counts: np.ndarray, title: str = "") -> str:
    """Render counts as a text table with one row per site, one column per class, and row/column totals."""
    num_sites, num_classes = counts.shape
    header = ["site", *(str(c) for c in range(num_classes)), "total"]
    rows = [[f"site-{s + 1}", *map(str, counts[s]), str(counts[s].sum())] for s in range(num_sites)]
    rows.append(["total", *map(str, counts.sum(axis=0)), str(counts.sum())])
    widths = [max(len(row[col]) for row in [header, *rows]) for col in range(len(header))]

    def render(row: list[str]) -> str:
        cells = [
            cell.ljust(w) if col == 0 else cell.rjust(w) for col, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells)

    lines = [title] if title else []
    lines += [render(header), *(render(row) for row in rows)]
    return "\n".join(lines)


def save_counts_heatmap(counts: np.ndarray, path: str | Path, title: str) -> Path:
    """Write a PNG heatmap of ``counts`` (sites x classes) with each cell's count written on it; returns the path."""
    # Figure + Agg canvas directly, not pyplot: no global backend switch, safe in headless and threaded processes.
    FigureCanvasAgg = require("matplotlib.backends.backend_agg", "plots", "the partition heatmap").FigureCanvasAgg
    from matplotlib.figure import Figure

    num_sites, num_classes = counts.shape
    fig = Figure(figsize=(max(6.0, 0.7 * num_classes + 2.0), max(2.5, 0.45 * num_sites + 1.6)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(counts, cmap="Blues", aspect="auto", vmin=0)
    fig.colorbar(image, ax=ax, label="samples")
    ax.set_xticks(range(num_classes), [str(c) for c in range(num_classes)])
    ax.set_yticks(range(num_sites), [f"site-{s + 1}" for s in range(num_sites)])
    ax.set_xlabel("class")
    ax.set_ylabel("site")
    ax.set_title(title, fontsize=9)
    if counts.size <= _MAX_ANNOTATED_CELLS:
        _annotate(ax, counts)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)
    return path


def _annotate(ax: object, counts: np.ndarray) -> None:
    """Write each count on its cell, white on dark cells so it stays readable."""
    threshold = counts.max() / 2 if counts.size else 0
    for (site, cls), value in np.ndenumerate(counts):
        colour = "white" if value > threshold else "black"
        ax.text(cls, site, str(value), ha="center", va="center", fontsize=7, color=colour)  # type: ignore[attr-defined]
