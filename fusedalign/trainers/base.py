"""What every fusedalign trainer shares: global loss normalisation, metrics, logging.

A subclass implements two things:
  - `count_items(inputs)`: how many loss units (pairs, examples, tokens) a micro-batch
    holds, computed from the batch alone before any forward, as a 0-dim tensor on the
    batch's device (so that counting never waits for the GPU);
  - `loss_and_metrics(model, inputs, mode)`: the SUM of the per-unit losses of the
    micro-batch and a dict of metric sums and counts.
The base turns the sum into a loss normalised by the global number of units in the
optimizer step (all micro-batches, all ranks), so the update does not depend on how a
global batch is split across gradient-accumulation steps and ranks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from fusedalign.head import TokenLogProbs, token_logprobs
from fusedalign.trainers.callbacks import MetricsJSONLCallback

Metrics = dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (sum, count): scalars or per-example [B]


def disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


class FusedAlignTrainer(Trainer):
    """Base of the fusedalign trainers (a `transformers.Trainer`)."""

    # Metrics logged as totals per optimizer step (example counts, say) instead of means:
    # in training, the sum over the logging window divided by its optimizer steps; in
    # evaluation, the sum over the evaluation. The count half of their (sum, count) is ignored.
    sum_metrics: frozenset[str] = frozenset()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # compute_loss already divides by the global count of the whole optimizer step;
        # Trainer must not divide by the accumulation steps again.
        self.loss_is_scaled_for_ga = True
        self._metric_totals: dict[str, dict[str, list[float]]] = {
            "train": defaultdict(lambda: [0.0, 0.0]),
            "eval": defaultdict(lambda: [0.0, 0.0]),
        }
        # Sums not yet read back to the host, per mode: names -> [2K] float64 on the device
        # (added to each micro-batch without a host sync; read when the metrics are).
        self._metric_pending: dict[str, dict[tuple[str, ...], torch.Tensor]] = {"train": {}, "eval": {}}
        self._steps_since_log = 0  # optimizer steps in the current training logging window
        self.add_callback(MetricsJSONLCallback())

    # ---------------------------------------------------------------- subclass API

    def count_items(self, inputs: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def loss_and_metrics(self, model: nn.Module, inputs: dict[str, Any], mode: str) -> tuple[torch.Tensor, Metrics]:
        raise NotImplementedError

    # ---------------------------------------------------------------- shared helpers

    def token_logprobs(self, model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor, **stats: bool) -> TokenLogProbs:
        """The one way a trainer gets log-probs: fused or not, never by reading weights."""
        return token_logprobs(
            model, inputs, labels, fused=self.args.fused_head, temperature=getattr(self.args, "temperature", 1.0), **stats
        )

    # ---------------------------------------------------------------- normalisation

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        self._steps_since_log += 1
        counts = [torch.as_tensor(self.count_items(batch), device=device).float() for batch in batch_samples]
        local = torch.stack(counts).sum() if counts else torch.zeros((), device=device)
        total = self.accelerator.reduce(local, reduction="sum")
        return batch_samples, total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        loss_sum, metrics = self.loss_and_metrics(model, inputs, mode)
        if num_items_in_batch is None:
            # Evaluation (or a caller outside the training loop): a local mean.
            loss = loss_sum / torch.as_tensor(self.count_items(inputs), device=loss_sum.device).clamp(min=1)
        else:
            # Backends average gradients over ranks, so multiply by the world size to get
            # sum(all units) / count(all units) in the end.
            loss = loss_sum * (self.accelerator.num_processes / num_items_in_batch.clamp(min=1))
        self._record(mode, metrics)
        return (loss, None) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # ---------------------------------------------------------------- metrics

    def _record(self, mode: str, metrics: Metrics) -> None:
        """Adds this micro-batch's metric sums and counts, over all ranks, on the device.

        Values are scalars, or per-example tensors `[B]`. In evaluation, per-example
        values are gathered with `gather_for_metrics`, which drops the rows accelerate
        repeats to even out the last batch across ranks; scalars are summed over ranks.
        Nothing here waits for the GPU: the sums are read back when `_metric_sums` is
        (at logging), so the host keeps queueing the backward pass meanwhile.
        """
        if not metrics:
            return
        names = tuple(sorted(metrics))
        device = self.accelerator.device
        values = [torch.as_tensor(v, dtype=torch.float64, device=device).detach() for n in names for v in metrics[n]]
        rows = {v.shape[0] for v in values if v.dim() == 1}
        if mode == "eval" and len(rows) == 1 and all(v.dim() == 1 for v in values):
            flat = self.accelerator.gather_for_metrics(torch.stack(values, dim=-1)).sum(0)  # [rows, 2K] -> [2K]
        else:
            flat = self.accelerator.reduce(torch.stack([v.sum() for v in values]), reduction="sum")
        pending = self._metric_pending[mode]
        pending[names] = pending[names] + flat if names in pending else flat

    @property
    def _metric_sums(self) -> dict[str, dict[str, list[float]]]:
        """Per mode, name -> [sum, count] as floats, everything recorded so far read back."""
        for mode, pending in self._metric_pending.items():
            for names, flat in pending.items():
                values = flat.tolist()
                for i, name in enumerate(names):
                    acc = self._metric_totals[mode][name]
                    acc[0] += values[2 * i]
                    acc[1] += values[2 * i + 1]
            pending.clear()
        return self._metric_totals

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        sums = self._metric_sums[mode]
        steps = max(self._steps_since_log, 1) if mode == "train" else 1
        for name, (total, count) in sums.items():
            if name in self.sum_metrics:
                logs[prefix + name] = total / steps
            elif count > 0:
                logs[prefix + name] = total / count
        sums.clear()
        if mode == "train":
            self._steps_since_log = 0
        super().log(logs, start_time)
