"""Training curves from a run's `metrics.jsonl`, drawn to a PNG."""

from __future__ import annotations

import json
import math
import os

# The curves each method cares about, in display order; others present are skipped.
CURVES = (
    "loss", "eval_loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected",
    "kl", "mean_token_accuracy", "entropy",
)


def read_metrics(path: str) -> list[dict]:
    """Reads a metrics JSONL file; a truncated last line (a run killed mid-write) is skipped."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not valid JSON ({err.msg}).") from None
    return records


def plot_run(output_dir: str, out_file: str | None = None) -> str:
    """Draws the training curves of the run in `output_dir` and returns the PNG's path.

    Raises:
        FileNotFoundError: `output_dir/metrics.jsonl` does not exist.
        ValueError: It holds no curve to draw.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No metrics to plot: {path} does not exist (is {output_dir} a fusedalign output dir?).")
    records = read_metrics(path)
    series: dict[str, tuple[list[float], list[float]]] = {}
    for record in records:
        for name in CURVES:
            key = name if name in record else f"eval_{name}" if f"eval_{name}" in record and name != "eval_loss" else None
            if key is None or not isinstance(record.get(key), (int, float)):
                continue
            xs, ys = series.setdefault(key, ([], []))
            xs.append(record["step"])
            ys.append(record[key])
    if not series:
        raise ValueError(f"{path} holds no curve to draw (looked for {', '.join(CURVES)}).")
    cols = min(3, len(series))
    rows = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, (xs, ys)) in zip(axes.flat, series.items()):
        ax.plot(xs, ys, marker="." if len(xs) < 50 else None)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.suptitle(os.path.basename(os.path.abspath(output_dir)))
    fig.tight_layout()
    out_file = out_file or os.path.join(output_dir, "training_curves.png")
    fig.savefig(out_file, dpi=110)
    plt.close(fig)
    return out_file
