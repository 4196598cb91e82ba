"""What the base logs beside the metrics' windows, and the counts it logs.

`log` adds the window's metrics (`MetricsRecorder.read`, over the optimizer steps since the
last training log) and TRL's `num_tokens`, then lets a trainer add values computed from the
window's other values (`complete_logs`; `RolloutSteps` adds `policy_loss`). Input tokens are
counted once a step, in the base's `get_batch_samples` (one reduction with the loss units, no
host sync), into `_tokens_pending` on the device, and folded into the Trainer state only when
read (`num_input_tokens_seen`), so the count survives a resume with the state. A mixin of
`FusedAlignTrainer` (`trainers/base.py`), which creates `metrics` and `_tokens_pending`;
`_fusedalign_last_logged` is also reset on resume (`trainers/resume_state.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from fusedalign.trainers.step_batch import StepBatch


class StepLogging:
    """The logs' metrics and counters (input tokens, floating point operations)."""

    def count_input_tokens(self, inputs: StepBatch | dict[str, Any]) -> torch.Tensor:
        """Input tokens of a prepared micro-batch, padding excluded (TRL's `num_tokens`)."""
        if isinstance(inputs, StepBatch):
            return inputs.input_tokens()
        if "attention_mask" in inputs:
            return inputs["attention_mask"].sum()
        return torch.as_tensor(inputs["input_ids"].numel(), device=inputs["input_ids"].device)

    def floating_point_ops(self, inputs: StepBatch | dict[str, Any]) -> int:
        """Trainer's count (`6 x tokens x non-embedding parameters`), for typed batches too."""
        if isinstance(inputs, StepBatch) and hasattr(self.model, "num_parameters"):
            return 6 * inputs.forward_tokens() * self.model.num_parameters(exclude_embeddings=True)
        return super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs):
        """Counted per step in `get_batch_samples` instead (one reduction a step, no host sync)."""

    @property
    def num_input_tokens_seen(self) -> float:
        """Input tokens trained on so far, all ranks (padding excluded); kept in the Trainer state."""
        pending = float(self._tokens_pending)
        if pending:
            self.state.num_input_tokens_seen += pending
            self._tokens_pending.zero_()
        return self.state.num_input_tokens_seen

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        steps = 1
        if mode == "train":  # optimizer steps since the last training log
            steps = self.state.global_step - getattr(self, "_fusedalign_last_logged", 0)
            self._fusedalign_last_logged = self.state.global_step
        prefix = "eval_" if mode == "eval" else ""
        for name, value in self.metrics.read(mode, steps).items():
            logs[prefix + name] = value
        if mode == "train" and "loss" in logs:
            logs["num_tokens"] = self.num_input_tokens_seen
        elif mode == "eval":  # TRL logs the training count in evaluation too
            logs["eval_num_tokens"] = self.num_input_tokens_seen
        self.complete_logs(logs, mode)
        super().log(logs, start_time)

    def complete_logs(self, logs: dict[str, float], mode: str) -> None:
        """Values a trainer logs as functions of the window's other values (none here)."""
