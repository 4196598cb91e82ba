"""One Trainer step per part of a micro-batch in parts (`MicroBatchParts`, `trainers/step_batch.py`).

On-policy trainers cannot change the number of micro-batches of a step (their completions are
generated after the dataloader fixed it), so a micro-batch over the token budget comes as parts.
Each part runs the Trainer's own `training_step` (its loss scaling, DeepSpeed's `scale_wrt_gas`,
its backward), and every part but the last, within the micro-batch that synchronises gradients,
runs in the context the Trainer gives its non-final micro-batches, so the gradients are reduced
once, after the last. A mixin of `FusedAlignTrainer` (`trainers/base.py`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from accelerate.utils import DistributedType
from torch import nn

from fusedalign.trainers.step_batch import MicroBatchParts


class PartSteps:
    """The backward of a micro-batch in parts, its gradient synchronisation deferred to the last part."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        """A micro-batch in parts (`MicroBatchParts`): one forward and backward per part, the
        gradient synchronisation of the Trainer's last micro-batch deferred to the last part."""
        if not isinstance(inputs, MicroBatchParts):
            return super().training_step(model, inputs, num_items_in_batch)
        last = len(inputs.parts) - 1
        losses = []
        for j, part in enumerate(inputs.parts):
            with self._deferred_sync(model, j < last):
                losses.append(super().training_step(model, part, num_items_in_batch))
        return torch.stack(losses).sum()

    @contextlib.contextmanager
    def _deferred_sync(self, model: nn.Module, defer: bool):
        """Within the Trainer's micro-batch that synchronises gradients, a backward that must not
        yet: the context the Trainer gives its other micro-batches, and `sync_gradients` off (so
        that accelerate runs DeepSpeed's backward without its boundary and optimizer step)."""
        state = self.accelerator.gradient_state
        if not defer or not state.sync_gradients:
            yield  # the last part, or the Trainer's loop has already deferred this micro-batch
            return
        if (self.accelerator.distributed_type == DistributedType.DEEPSPEED
                or state.plugin_kwargs.get("sync_each_batch", False)):
            context = contextlib.nullcontext  # DeepSpeed: sync_gradients off defers; sync_each_batch: none does
        elif getattr(self, "is_distributed_loading_by_transformers", False) and hasattr(
                self, "_defer_fsdp_gradient_reduction"):
            context = self._defer_fsdp_gradient_reduction  # a model transformers sharded at load time
        else:
            context = functools.partial(self.accelerator.no_sync, model=model)
        state._set_sync_gradients(False)
        try:
            with context():
                yield
        finally:
            state._set_sync_gradients(True)
