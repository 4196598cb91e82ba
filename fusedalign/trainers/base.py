"""The seam every fusedalign trainer is built on.

A trainer is a `transformers.Trainer` subclass that implements three methods, and
nothing of the training loop, the backend or the logging:

  - `prepare_step(model, batches, mode) -> batches`: called once per optimizer step with
    that step's micro-batches (all of them, before any forward of the step), and once per
    batch in evaluation (each evaluation batch is its own step). Per-step work goes here:
    reference log-probs, KTO's KL reference point over the whole step, GRPO's generation
    and scoring. It returns the micro-batches the step trains on: typed, frozen
    `StepBatch` objects whose optional parts are declared (`old_logps: Tensor | None`),
    so that a part the step needs cannot be silently absent (or, for trainers not yet
    moved to them, the same dicts with keys added, each marked prepared).
  - `count_items(inputs) -> Tensor []`: how many loss units (pairs, examples, tokens) a
    prepared micro-batch holds, from the batch alone, as a 0-dim tensor on its device (so
    that counting never waits for the device).
  - `loss_and_metrics(model, inputs, mode) -> (loss_sum, metrics)`: the SUM of the
    micro-batch's per-unit losses (connected to the graph even when it is zero) and its
    metrics, a `fusedalign.metrics.MetricSet` (or several) whose fields declare how they
    reduce.

A prepared micro-batch may be a `MicroBatchParts` (a token budget below its tokens): the
base then runs one forward and backward per part, deferring the gradient synchronisation to
the last (`training_step`, `trainers/part_steps.py`): `loss_and_metrics` sees one part at a
time, `count_items` the whole micro-batch.

The base divides `loss_sum` by the number of units in the whole optimizer step over all
ranks, so the update does not depend on how a global batch is split across ranks and
gradient-accumulation steps. It records metrics with `MetricsRecorder` (evaluation drops
the rows accelerate repeats, for every statistic) and logs them per window. It owns its
counters: input tokens seen (`num_tokens`, kept in the Trainer state, so it survives a
resume) and the state of any component registered with `checkpointed(name, obj)` (an
object with `state_dict()`/`load_state_dict()`), written into every checkpoint and read
back on resume; `checkpointed(name, obj, per_rank=True)` keeps one state per rank (a
rank's GRPO generation window: its completions and the log-probs computed for them).
The logging and its counters are in `trainers/step_logging.py`, the checkpointed state in
`trainers/resume_state.py`: mixins of this class, which creates their state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Trainer

from fusedalign.distributed import prepare_trainer_process
from fusedalign.head import TokenLogProbs, token_logprobs
from fusedalign.metrics import Metrics, MetricsRecorder
from fusedalign.trainers.callbacks import MetricsJSONLCallback
from fusedalign.trainers.component_states import RANK_STATE_FILE, STATE_FILE, CheckpointError, ComponentStates
from fusedalign.trainers.part_steps import PartSteps
from fusedalign.trainers.resume_state import ResumeState
from fusedalign.trainers.step_batch import (
    PREPARED,
    MicroBatchParts,
    MissingPartError,
    StepBatch,
    is_prepared,
    require_parts,
)
from fusedalign.trainers.step_logging import StepLogging

# The seam's types are re-exported here, where trainers and tests import them from.

__all__ = ["CheckpointError", "FusedAlignTrainer", "MicroBatchParts", "MissingPartError", "PREPARED",
           "RANK_STATE_FILE", "STATE_FILE", "StepBatch", "is_prepared", "require_parts"]


class FusedAlignTrainer(StepLogging, ResumeState, PartSteps, Trainer):
    """Base of the fusedalign trainers (a `transformers.Trainer`); see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any):
        prepare_trainer_process(kwargs.get("args"))
        super().__init__(*args, **kwargs)
        # compute_loss already divides by the global count of the whole optimizer step;
        # Trainer must not divide by the accumulation steps again.
        self.loss_is_scaled_for_ga = True
        self.metrics = MetricsRecorder(self.accelerator)
        self._components = ComponentStates()
        self._rng_pending: str | None = None  # a checkpoint whose RNG states are still to be restored
        self._tokens_pending = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        self.add_callback(MetricsJSONLCallback())

    # ---------------------------------------------------------------- subclass API

    def prepare_step(self, model: nn.Module, batches: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
        return batches

    def count_items(self, inputs: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def loss_and_metrics(self, model: nn.Module, inputs: dict[str, Any], mode: str) -> tuple[torch.Tensor, Metrics]:
        raise NotImplementedError

    # ---------------------------------------------------------------- shared helpers

    def token_logprobs(self, model: nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                       **stats: Any) -> TokenLogProbs:
        """The one way a trainer gets log-probs: fused or not, never by reading weights.

        `targets` [B, T] are already shifted (`targets[:, t]` is predicted at position t); `stats`
        are `fusedalign.head.token_logprobs`' keywords (entropy, logit_mean, argmax, log_sum_sq_probs,
        row_loss, ...), passed on unchanged.
        """
        return token_logprobs(model, inputs, targets=targets, fused=self.args.fused_head,
                              temperature=getattr(self.args, "temperature", 1.0), **stats)

    # ---------------------------------------------------------------- the step

    def _prepared(self, model: nn.Module, batches: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
        if all(is_prepared(batch) for batch in batches):
            return batches
        with self.compute_loss_context_manager():
            batches = self.prepare_step(model, batches, mode)
        for batch in batches:
            if not isinstance(batch, StepBatch):
                batch[PREPARED] = True
        return batches

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        """Nothing is dropped whatever `remove_unused_columns` says: each trainer reads the columns of its
        data format itself (Trainer would keep only the model's forward arguments, which no row has)."""
        return dataset

    def _get_collator_with_removed_columns(self, data_collator: Any, description: str | None = None) -> Any:
        return data_collator

    def _prepare_inputs(self, inputs):
        return inputs if isinstance(inputs, StepBatch) else super()._prepare_inputs(inputs)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        if batch_samples:
            if self._rng_pending is not None:
                # Resumed mid-epoch, Trainer restores the RNG states only after this method, but the
                # step's preparation (GRPO's sampling) draws here: restore them first (once).
                self._load_rng_state(self._rng_pending)
            self.model_wrapped.train()  # as training_step will; the step's work runs in training mode
            batch_samples = self._prepared(self.model_wrapped, batch_samples, "train")
        counts = [torch.stack([torch.as_tensor(self.count_items(b), device=device).double(),
                               torch.as_tensor(self.count_input_tokens(b), device=device).double()])
                  for b in batch_samples]
        local = torch.stack(counts).sum(0) if counts else torch.zeros(2, dtype=torch.float64, device=device)
        total = self.accelerator.reduce(local, reduction="sum")  # [items, input tokens] of the step, all ranks
        self._tokens_pending = self._tokens_pending.to(total.device) + total[1]
        return batch_samples, total[0].float()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        if not is_prepared(inputs):
            # Evaluation, or a caller outside the training loop: the batch is its own step.
            inputs = self._prepared(model, [inputs], mode)[0]
        # A micro-batch in parts reaches here whole only outside training_step: the parts' sum.
        loss_sum = None
        for part in inputs.parts if isinstance(inputs, MicroBatchParts) else (inputs,):
            part_sum, metrics = self.loss_and_metrics(model, part, mode)
            self.metrics.record(mode, metrics)
            loss_sum = part_sum if loss_sum is None else loss_sum + part_sum
        if num_items_in_batch is None:
            # Evaluation (or a caller outside the training loop): a local mean.
            loss = loss_sum / torch.as_tensor(self.count_items(inputs), device=loss_sum.device).clamp(min=1)
        else:
            # Backends average gradients over ranks, so multiply by the world size to get
            # sum(all units) / count(all units) in the end.
            loss = loss_sum * (self.accelerator.num_processes / num_items_in_batch.clamp(min=1))
        return (loss, None) if return_outputs else loss

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        """Evaluation on forked RNG states: whatever it draws (its dataloader's seed, GRPO's
        sampling), training after it draws as if it had not run."""
        device = self.accelerator.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            return super().evaluation_loop(*args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
