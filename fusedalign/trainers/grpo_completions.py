"""TRL's `log_completions`: the prompts, completions and rewards of training, printed and kept.

At each logging step the completions generated since the last one (every rank's, gathered
in rank order) are appended to `OUTPUT_DIR/completions.jsonl`, one JSON object a
completion (step, prompt, completion, each reward function's value, the advantage; a run
without reward functions, distillation, has neither: its rows carry no `rewards` and no
`advantage`), and the first `num_completions_to_print` of them (None: all) are printed as a table. TRL prints with
rich and writes parquet; a table of plain text and JSON lines need no extra package.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

import torch

FILE = "completions.jsonl"
WIDTH = 60  # characters of a prompt or completion in the printed table


class CompletionLog:
    """Collects training completions between two logging steps (a no-op when disabled)."""

    def __init__(self, enabled: bool, accelerator: Any):
        self.enabled, self.accelerator = enabled, accelerator
        self.pending: list[dict[str, Any]] = []

    def add(self, step: int, prompts: Sequence[Any], completions: Sequence[str], rewards: torch.Tensor,
            names: Sequence[str], advantages: torch.Tensor) -> None:
        """One generation's rows on this rank (called on every rank: the rows are gathered)."""
        if not self.enabled:
            return
        from accelerate.utils import gather_object

        values = rewards.double().cpu().tolist()
        rows = [{"step": step, "prompt": p, "completion": c} for p, c in zip(prompts, completions)]
        if names:  # no reward function (distillation): no rewards, and no advantage to show
            for row, r, a in zip(rows, values, advantages.double().cpu().tolist()):
                row.update(rewards={n: _number(v) for n, v in zip(names, r)}, advantage=_number(a))
        gathered = gather_object(rows) if self.accelerator.num_processes > 1 else rows
        if self.accelerator.is_main_process:
            self.pending.extend(gathered)

    def flush(self, output_dir: str, num_to_print: int | None) -> None:
        """Writes and prints what was collected since the last call (main process)."""
        if not self.pending:
            return
        rows, self.pending = self.pending, []
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, FILE), "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        shown = rows if num_to_print is None else rows[:num_to_print]
        if shown:
            print("\n" + format_table(shown), flush=True)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table: step, prompt, completion, and the rewards and advantage where the rows have them."""
    scored = "advantage" in rows[0]
    names = list(rows[0]["rewards"]) if scored else []
    header = ["step", "prompt", "completion", *names, *(["advantage"] if scored else [])]
    body = [[str(r["step"]), _clip(_text(r["prompt"])), _clip(r["completion"]),
             *(_fmt(r["rewards"][n]) for n in names), *([_fmt(r["advantage"])] if scored else [])] for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in [header, *body]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _text(prompt: Any) -> str:
    """A prompt as text: a conversation shows its last message's content."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    return str(prompt)


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= WIDTH else text[: WIDTH - 3] + "..."


def _number(value: float) -> float | None:
    return None if value is None or math.isnan(value) else value


def _fmt(value: float | None) -> str:
    return "None" if value is None else f"{value:.4g}"
