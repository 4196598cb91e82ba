"""--recheck RESULTS_JSON: an earlier run's tables, agreement check and targets again,
with this run's tolerances (no training)."""

from __future__ import annotations

import argparse
import json

from benchmarks.dpo_modes import compare, real_lengths
from benchmarks.harness.env import log


def recheck(args) -> int:
    with open(args.recheck) as f:
        saved = json.load(f)
    old = argparse.Namespace(**saved["settings"])
    old.loss_atol, old.logps_atol = args.loss_atol, args.logps_atol
    log(f"recheck of {args.recheck} (argv: {' '.join(saved.get('argv', []))}); tolerances: loss {old.loss_atol:g}, "
        f"logps {old.logps_atol:g} nats")
    verdicts = {}
    for length, results in saved["results"].items():
        if not length.isdigit():
            log(f"{length}: nothing to recheck (not a throughput run)")
            continue
        if getattr(old, "real_lengths", None):
            log("\n" + real_lengths.table(int(length), results, saved.get("skipped", {}), old) + "\n")
            verdicts[length] = real_lengths.check_agreement(int(length), results, old)
            continue
        log("\n" + compare.table(int(length), results, saved.get("skipped", {}), old) + "\n")
        verdicts[length] = compare.check_agreement(int(length), results, old)
        compare.targets(int(length), results)
    return 0 if all(v != "void" for v in verdicts.values()) else 1
