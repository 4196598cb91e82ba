"""Callbacks every fusedalign trainer installs: the run's step-keyed logs.

`<output_dir>/metrics.jsonl` (and `completions.jsonl`, which `--log_completions` writes)
holds one run. A run resumed from a checkpoint keeps the records up to the checkpoint's
step and continues after them, so no step appears twice (the Trainer logs, evaluates and
only then saves a step, so every record of a step up to the checkpoint's is already in the
file). A new run that finds an older log moves it to `metrics.previous-<n>.jsonl`
(`completions.previous-<n>.jsonl`) instead of appending to it. The command line does the
same before it starts (fusedalign.cli.output_dir); this callback does it for a run started
from Python, and finds nothing left to do after the command line.
"""

from __future__ import annotations

import json
import logging
import os

from transformers import TrainerCallback

from fusedalign.trainers.grpo_completions import FILE as COMPLETIONS_FILE  # --log_completions' file

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
STEP_LOGS = (METRICS_FILE, COMPLETIONS_FILE)  # JSON lines, each record with its `step`


def keep_until_step(path: str, step: int) -> int:
    """Rewrites a step-keyed log without the records past `step` (and without broken lines); returns how many went."""
    with open(path) as f:
        lines = f.read().splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short when the earlier process was killed
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return sum(1 for line in lines if line.strip()) - len(kept)


def move_aside(path: str) -> str:
    """Renames an older log to the first free `<name>.previous-<n>.jsonl` and returns the new path."""
    base, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(f"{base}.previous-{n}{ext}"):
        n += 1
    os.replace(path, f"{base}.previous-{n}{ext}")
    return f"{base}.previous-{n}{ext}"


class MetricsJSONLCallback(TrainerCallback):
    """Appends every logged dict, with its step, to `<output_dir>/metrics.jsonl` (one run per file)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        for name in STEP_LOGS:
            path = os.path.join(args.output_dir, name)
            if not os.path.isfile(path):
                continue
            if state.global_step > 0:  # resumed: the checkpoint's step is where this run's log goes on
                dropped = keep_until_step(path, state.global_step)
                if dropped:
                    logger.info("%s: %d records past the checkpoint's step %d dropped (they are logged "
                                "again as training continues).", name, dropped, state.global_step)
            else:
                logger.warning("%s held the log of an earlier run; moved to %s.", path, move_aside(path))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        record = {"step": state.global_step, "epoch": state.epoch, **logs}
        with open(os.path.join(args.output_dir, METRICS_FILE), "a") as f:
            f.write(json.dumps(record, default=float) + "\n")
