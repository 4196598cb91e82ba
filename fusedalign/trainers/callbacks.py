"""Callbacks every fusedalign trainer installs: the run's metrics log."""

from __future__ import annotations

import json
import os

from transformers import TrainerCallback


class MetricsJSONLCallback(TrainerCallback):
    """Appends every logged dict, with its step, to `<output_dir>/metrics.jsonl`."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        record = {"step": state.global_step, "epoch": state.epoch, **logs}
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record, default=float) + "\n")
