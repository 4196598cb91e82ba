"""What DPO and KTO share: a reference, their rows (padded or padding-free) and their sampling.

`PreferenceTrainer` holds the components a preference trainer sets up after
`Trainer.__init__` (`setup_preference`): the reference (`Reference`, with its optional
precomputed store) and the micro-batch plan (`MicroBatches`: a token budget, or length
grouping), routes the Trainer's dataloader and sampler hooks to the plan, and reads its
collated batches as `PackedRows` (`rows_of`), the one row layout, whichever collator made them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from torch import nn

from fusedalign.data.packed_rows import PackedRows

from fusedalign.trainers.base import FusedAlignTrainer
from fusedalign.trainers.policy import Policy
from fusedalign.trainers.preference_inputs import MicroBatches
from fusedalign.trainers.reference import PrecomputedLogps, Reference


class PreferenceTrainer(FusedAlignTrainer):
    """Base of DPOTrainer and KTOTrainer (see the module docstring)."""

    def setup_preference(self, policy: Policy, reference: nn.Module | None, *, needed: bool,
                         row_tokens: Callable[[Mapping], int], padded_length: Callable[[Mapping], int]) -> None:
        """The reference component, the row layout and the micro-batch plan (after `Trainer.__init__`)."""
        args = self.args
        self.reference = Reference.prepare(reference, self.accelerator, policy_is_peft=policy.is_peft, needed=needed,
                                           disable_dropout_=args.disable_dropout)
        self.reference_store = PrecomputedLogps() if args.precompute_ref_log_probs else None
        self.micro_batches = MicroBatches(args, row_tokens, padded_length)
        self.micro_batches.plan(self.train_dataset, self.accelerator.num_processes)

    def rows_of(self, batch: Mapping[str, Any], prefix: str = "", per_group: int = 1) -> PackedRows:
        """A collated batch's rows (the keys with `prefix`), `per_group` sequences a group when padded
        (DPO's chosen rows then rejected rows: 2)."""
        return PackedRows.from_collated(batch, packed=self.args.padding_free, prefix=prefix, per_group=per_group)

    @property
    def ref_model(self) -> nn.Module | None:
        return self.reference.model

    # ------------------------------------------------------------------ sampling

    def get_train_dataloader(self):
        return self.micro_batches.train_dataloader(self) or super().get_train_dataloader()

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        default = super()._get_train_sampler
        return self.micro_batches.train_sampler(dataset, lambda: default(dataset))

    def _get_eval_sampler(self, eval_dataset):
        default = super()._get_eval_sampler
        return self.micro_batches.eval_sampler(eval_dataset, lambda: default(eval_dataset))
