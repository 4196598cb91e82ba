"""Callbacks every fusedalign trainer installs: the run's metrics log.

`<output_dir>/metrics.jsonl` holds one run. A run resumed from a checkpoint keeps the
records up to the checkpoint's step and continues after them, so no step appears
twice (the Trainer logs, evaluates and only then saves a step, so every record of a
step up to the checkpoint's is already in the file). A new run that finds an older log
moves it to `metrics.previous-<n>.jsonl` instead of appending to it.
"""

from __future__ import annotations

import json
import logging
import os

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def keep_until_step(path: str, step: int) -> int:
    """Rewrites a metrics log without the records past `step` (and without broken lines); returns how many went."""
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
    """Renames an older log to the first free `metrics.previous-<n>.jsonl` and returns the new path."""
    base, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(f"{base}.previous-{n}{ext}"):
        n += 1
    os.replace(path, f"{base}.previous-{n}{ext}")
    return f"{base}.previous-{n}{ext}"


class MetricsJSONLCallback(TrainerCallback):
    """Appends every logged dict, with its step, to `<output_dir>/metrics.jsonl` (one run per file)."""

    def on_train_begin(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, METRICS_FILE)
        if not state.is_world_process_zero or not os.path.isfile(path):
            return
        if state.global_step > 0:  # resumed: the checkpoint's step is where this run's log goes on
            dropped = keep_until_step(path, state.global_step)
            if dropped:
                logger.info("metrics.jsonl: %d records past the checkpoint's step %d dropped (they are logged "
                            "again as training continues).", dropped, state.global_step)
        else:
            logger.warning("%s held the log of an earlier run; moved to %s.", path, move_aside(path))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        record = {"step": state.global_step, "epoch": state.epoch, **logs}
        with open(os.path.join(args.output_dir, METRICS_FILE), "a") as f:
            f.write(json.dumps(record, default=float) + "\n")
