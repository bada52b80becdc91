"""A dataset's distribution as the model sees it: images per sample, image tokens, text tokens.

:func:`distribution_record` gives the percentiles (a JSON-ready record), :func:`print_distribution`
the table, :func:`draw_distribution` one histogram per quantity into a PNG.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mpipe_tune.outputs import validate_out_path, write_together
from mpipe_tune.inputs import Dataset
from mpipe_tune.report._gantt import PICTURE_SUFFIXES

PERCENTILES = (0, 10, 50, 90, 99, 100)


def _quantities(dataset: Dataset) -> dict[str, np.ndarray]:
    r = dataset.records
    return {"images per sample": r.images_per_record, "image tokens per sample": r.image_tokens_per_record,
            "text tokens per sample": r.text_tokens, "tokens per image": r.image_tokens}


def distribution_record(dataset: Dataset) -> dict[str, Any]:
    """Counts and the percentiles (``p0`` ... ``p100``) and mean of each quantity."""
    spec = dataset.spec
    quantities = {}
    for name, values in _quantities(dataset).items():
        stats = {f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(values, PERCENTILES))} if len(values) else {}
        quantities[name] = {**stats, "mean": float(values.mean()) if len(values) else 0.0}
    return {"dataset": spec.path, "kind": dataset.kind, "records": len(dataset.records),
            "images": int(len(dataset.records.image_tokens)), "image_rule": spec.image_rule.describe(),
            "text_rule": "the manifest's text_tokens" if dataset.kind == "manifest" else spec.text_rule.describe(),
            "quantities": quantities}


def print_distribution(record: dict[str, Any]) -> None:
    print(f"{record['dataset']} ({record['kind']}): {record['records']} samples, {record['images']} images")
    print(f"images: {record['image_rule']}; text: {record['text_rule']}")
    header = "".join(f"{f'p{q}':>9s}" for q in PERCENTILES) + f"{'mean':>10s}"
    print(f"{'':26s}{header}")
    for name, stats in record["quantities"].items():
        cells = "".join(f"{stats[f'p{q}']:9.0f}" if f"p{q}" in stats else f"{'-':>9s}" for q in PERCENTILES)
        print(f"{name:26s}{cells}{stats['mean']:10.1f}")


def draw_distribution(dataset: Dataset, path: str | os.PathLike) -> None:
    """Histograms of images per sample, image tokens per sample and text tokens per sample, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = validate_out_path(path, label="distribution picture", suffixes=PICTURE_SUFFIXES)
    names = ("images per sample", "image tokens per sample", "text tokens per sample")
    values = _quantities(dataset)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, name in zip(axes, names):
        data = values[name]
        if name == "images per sample":
            bins = np.arange(-0.5, (data.max() if len(data) else 0) + 1.5)
        else:
            bins = min(60, max(1, len(np.unique(data))))
        ax.hist(data, bins=bins, color="#4f86c6", edgecolor="white", linewidth=0.3)
        p50, p90 = np.percentile(data, (50, 90))
        for q, v, style in (("p50", p50, "-"), ("p90", p90, "--")):
            ax.axvline(v, color="#c8553d", linestyle=style, linewidth=1, label=f"{q} {v:.0f}")
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("samples")
        ax.legend(fontsize=8, frameon=False)
    fig.suptitle(f"{dataset.name}: {len(dataset.records)} samples", fontsize=11)
    fig.tight_layout()
    try:
        write_together([(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))])
    finally:
        plt.close(fig)
