"""The step bookkeeping GRPO, RLOO and distillation share, beside what their losses compute.

`serve` takes the step's micro-batches from the rollout (a window generated at its start, each
micro-batch then served `num_iterations` times) and `served` notes which ones a window serves
again, so that `count_input_tokens` counts a generation's tokens once (TRL's `num_tokens`); the
optimizer step is timed from the start of its preparation (its generation, when due) to its last
backward (TRL's `step_time`); and with an entropy bonus the logs get TRL's `policy_loss` (the
loss without the bonus) and `entropy_coef`. A mixin of `FusedAlignTrainer` subclasses that hold
a `rollout` (`trainers/grpo_rollout.py`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from fusedalign.metrics import Mean
from fusedalign.trainers.grpo_batch import GRPOMicroBatch
from fusedalign.trainers.rollout_types import StepTime


class RolloutSteps:
    """Serving, token counting, step timing and the policy loss of the trainers that generate."""

    def serve(self, model: nn.Module, batches: list[dict[str, Any]], mode: str) -> list[GRPOMicroBatch]:
        """The step's micro-batches from the rollout: a new window generated at the start of each, its
        micro-batches then served in order, `num_iterations` times each."""
        if mode != "train":
            return [self.rollout.eval_batch(model, item["rows"], self.state) for item in batches]
        prepared, again = [], []
        for item in batches:
            prepared.append(self.rollout.train_batch(model, item["rows"], self.state))
            again.append(not self.rollout.window.last_was_first_use)
        self._served_again = again
        return prepared

    def served(self, prepared: list[GRPOMicroBatch]) -> list[GRPOMicroBatch]:
        """Notes which of the step's final micro-batches a window serves again (their tokens counted once)."""
        again = getattr(self, "_served_again", [False] * len(prepared))
        self._again_ids = {id(b) for b, repeat in zip(prepared, again) if repeat}
        return prepared

    def count_input_tokens(self, inputs: GRPOMicroBatch) -> torch.Tensor:
        """A window's tokens count once (TRL's `num_tokens`), not again at each of its `num_iterations`."""
        if id(inputs) in getattr(self, "_again_ids", ()):
            return torch.zeros(())
        return super().count_input_tokens(inputs)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        self._step_started = time.perf_counter()  # the step's generation (when due) is timed with it
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        started = getattr(self, "_step_started", None)
        if started is not None and self.accelerator.sync_gradients:  # the step's last micro-batch
            seconds = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
            self.metrics.record("train", StepTime(Mean(seconds, torch.ones_like(seconds))))
            self._step_started = None
        return loss

    def complete_logs(self, logs: dict[str, float], mode: str) -> None:
        """With an entropy bonus, TRL's `policy_loss` (the loss without it) and `entropy_coef`."""
        prefix = "eval_" if mode == "eval" else ""
        entropy = logs.pop(prefix + "bonus_entropy", None)
        if entropy is not None and prefix + "loss" in logs:
            logs[prefix + "policy_loss"] = logs[prefix + "loss"] + self.args.entropy_coef * entropy
            logs[prefix + "entropy_coef"] = self.args.entropy_coef
