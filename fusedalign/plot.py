"""Training curves from a run's `metrics.jsonl`, drawn to a PNG.

One panel per metric, its training and evaluation values together (`loss` and
`eval_loss` on one panel). Metric groups such as GRPO's `clip_ratio/*` share a panel.
Every metric of `CURVES` that was logged is drawn, constant ones too: a reward that is 0
all along (so its advantages, and a GRPO loss, are 0 too) or a clip ratio that never clips
is what a reader needs to see, so a constant line says so in its legend ("= 0 throughout"),
and a panel whose every line is constant says so in its middle.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from typing import NamedTuple

# The metrics drawn, in display order; a pattern ending in "/*" that is listed in GROUPED
# puts its metrics on one panel, any other pattern gives each match a panel of its own.
CURVES = (
    "loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "reward", "reward_std",
    "frac_reward_zero_std", "rewards/*", "kl", "entropy", "mean_token_accuracy", "completions/mean_length", "clip_ratio/*",
)
GROUPED = frozenset({"clip_ratio/*"})
EVAL_PREFIX = "eval_"


class Series(NamedTuple):
    steps: list[float]
    values: list[float]


def read_metrics(path: str) -> list[dict]:
    """Reads a metrics JSONL file; a truncated last line (a run killed mid-write) is skipped."""
    records = []
    with open(path) as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise ValueError(f"{path}, line {number}: not valid JSON ({err.msg}).") from None
    return records


def last_run(records: list[dict]) -> list[dict]:
    """The records of the last run in a log that holds several appended ones (steps going back)."""
    start = 0
    for i in range(1, len(records)):
        if records[i].get("step", 0) < records[i - 1].get("step", 0):
            start = i
    return records[start:]


def _panel_of(name: str) -> tuple[int, str] | None:
    for order, pattern in enumerate(CURVES):
        if name == pattern or (pattern.endswith("*") and fnmatch.fnmatchcase(name, pattern)):
            return order, (pattern[:-2] if pattern in GROUPED else name)
    return None


def panels(records: list[dict]) -> dict[str, dict[str, Series]]:
    """Panel title -> line label -> series, in display order (lines with no finite value left out)."""
    found: dict[tuple[int, str], dict[str, Series]] = {}
    for record in last_run(records):
        for key, value in record.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or key in ("step", "epoch"):
                continue
            evaluation = key.startswith(EVAL_PREFIX)
            name = key[len(EVAL_PREFIX):] if evaluation else key
            where = _panel_of(name)
            if where is None:
                continue
            grouped = where[1] != name
            label = (f"{name.split('/', 1)[1]} " if grouped else "") + ("eval" if evaluation else "train")
            series = found.setdefault(where, {}).setdefault(label, Series([], []))
            series.steps.append(record.get("step", 0))
            series.values.append(float(value))
    out = {}
    for (_, title), lines in sorted(found.items()):
        kept = {label: s for label, s in lines.items() if any(math.isfinite(v) for v in s.values)}
        if kept:
            out[title] = kept
    return out


def constant_value(series: Series) -> float | None:
    """The value a line holds at every step (its finite values all equal), or None."""
    finite = {v for v in series.values if math.isfinite(v)}
    return finite.pop() if len(finite) == 1 and len(series.values) > 1 else None


def line_label(label: str, series: Series) -> str:
    """A line's legend entry; a constant line says so ("train = 0 throughout")."""
    value = constant_value(series)
    return label if value is None else f"{label} = {value:g} throughout"


def run_panels(output_dir: str) -> dict[str, dict[str, Series]]:
    """The panels `plot_run` draws for the run in `output_dir` (see `panels`).

    Raises:
        FileNotFoundError: `output_dir/metrics.jsonl` does not exist.
        ValueError: It holds no curve to draw.
    """
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No metrics to plot: {path} does not exist (is {output_dir} a fusedalign output dir?).")
    drawn = panels(read_metrics(path))
    if not drawn:
        raise ValueError(f"{path} holds no curve to draw (looked for {', '.join(CURVES)}, train or eval).")
    return drawn


def panel_titles(output_dir: str) -> list[str]:
    """The titles of the panels `plot_run` draws for the run in `output_dir`, in display order
    (a group such as `clip_ratio/*` is one title, `clip_ratio`). Raises as `run_panels`."""
    return list(run_panels(output_dir))


def plot_run(output_dir: str, out_file: str | None = None) -> str:
    """Draws the training curves of the run in `output_dir` and returns the PNG's path.

    Raises:
        FileNotFoundError: `output_dir/metrics.jsonl` does not exist.
        ValueError: It holds no curve to draw.
    """
    drawn = run_panels(output_dir)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(drawn))
    rows = math.ceil(len(drawn) / cols)
    # A constrained layout keeps the figure title clear of the panels' titles.
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows + 0.4), squeeze=False, layout="constrained")
    for ax, (title, lines) in zip(axes.flat, drawn.items()):
        for label, series in lines.items():
            evaluation = label.endswith("eval")
            ax.plot(series.steps, series.values, label=line_label(label, series), linestyle="--" if evaluation else "-",
                    marker="o" if evaluation or len(series.steps) < 50 else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        constant = [constant_value(series) is not None for series in lines.values()]
        if all(constant):
            # A constant line sits in the panel's middle: the note above it, the legend below it.
            ax.legend(fontsize="small", loc="lower center")
            ax.text(0.5, 0.8, "constant", transform=ax.transAxes, ha="center", va="center", color="0.4",
                    fontsize="large", fontweight="bold", alpha=0.6)
        elif len(lines) > 1 or any(constant):
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(drawn):]:
        ax.axis("off")
    fig.suptitle(f"run: {os.path.basename(os.path.abspath(output_dir))}", x=0.01, ha="left", fontweight="bold")
    fig.get_layout_engine().set(h_pad=0.08)
    out_file = out_file or os.path.join(output_dir, "training_curves.png")
    fig.savefig(out_file, dpi=110)
    plt.close(fig)
    return out_file
