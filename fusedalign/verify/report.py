"""The table `fusedalign verify` prints: per run, the largest relative differences and a verdict."""

from __future__ import annotations

import json
import os
from typing import Any

from fusedalign.verify.compare import KINDS, TOLERANCES, Comparison, compare_run


def check_run(run: dict[str, Any], oracle_dir: str, error: str | None) -> Comparison:
    """Compares a run with its oracle, and checks it ran as asked (world size, backend)."""
    cmp = compare_run(run["label"], run["dir"], oracle_dir, error)
    result_file = os.path.join(run["dir"], "result.json")
    if cmp.crashed is None:
        with open(result_file) as f:
            result = json.load(f)
        if result["world_size"] != run["world"]:
            cmp.first = f"ran on {result['world_size']} process(es), {run['world']} asked for"
        elif run.get("distributed_type") and result["distributed_type"] != run["distributed_type"]:
            cmp.first = f"ran as {result['distributed_type']}, the config asks for {run['distributed_type']}"
    return cmp


def _cell(cmp: Comparison, kind: str) -> str:
    if cmp.crashed is not None:
        return "-"
    diff = cmp.kinds[kind]
    where = f" ({diff.where})" if kind in ("metrics", "weights") and diff.where and diff.value > 0 else ""
    return f"{diff.value:.1e}{where}"


def verdict(cmp: Comparison) -> str:
    if cmp.crashed is not None:
        return f"CRASHED: {cmp.crashed}"
    return "agrees" if cmp.first is None else f"DIFFERS: {cmp.first}"


def table(oracle_label: str, comparisons: list[Comparison]) -> str:
    """A markdown table: one row per run, the largest relative difference of each kind."""
    header = ["run", "dtype", *KINDS, "verdict"]
    rows = [[oracle_label, "float32", *("reference" for _ in KINDS), ""]]
    rows += [[c.name, c.dtype, *(_cell(c, k) for k in KINDS), verdict(c)] for c in comparisons]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def tolerance_note() -> str:
    parts = [f"{name}: {t.values:.0e} on loss and grad_norm, {t.metrics:.0e} on metrics, {t.weights:.0e} "
             "of the oracle's update on weights" for name, t in TOLERANCES.items()]
    return "largest relative differences from the oracle; tolerances " + "; ".join(parts) + "."
