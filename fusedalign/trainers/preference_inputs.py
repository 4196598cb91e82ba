"""How the DPO and KTO trainers check and sample their micro-batches.

Their rows, padded or packed, are read through one layout, `fusedalign.data.packed_rows.
PackedRows` (`PreferenceTrainer.rows_of`): per-sequence values come back `[S]` in the same
order either way (DPO: chosen 0..B-1, then rejected; KTO: completions, or in the joint row
completions then KL partners), summed in fp64 and rounded once, as the loss-aware head sums.
A packed row's forward arguments are built once per row and model signature and kept by the
row, so the reference's forward in the step's preparation and the policy's later share them.

`MicroBatches` samples: by token budget (`max_tokens_per_batch`: `TokenBudgetBatchSampler`,
as many micro-batches on every rank, whole pairs or examples each; the base's normaliser
counts the step's units however many each micro-batch holds), or grouped by length for
padded rows (`train_sampling_strategy="group_by_length"`: `LengthGroupedSampler`, since
TrainingArguments' own grouping needs a `length` or `input_ids` column these rows lack).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, SequentialSampler

from fusedalign.attention import check_preference_attention
from fusedalign.attention.selection import choose_packed_attention
from fusedalign.data.samplers import LengthGroupedSampler, TokenBudgetBatchSampler


def check_models(args: Any, *models: nn.Module | None) -> None:
    """At the trainer's init: on CUDA, the attention whose cost follows the segments (flex by default,
    `attention.selection`); refuses a policy or reference that cannot isolate packed sequences."""
    if args.padding_free:
        choose_packed_attention(args, *models)
        for model in models:
            if model is not None:
                check_preference_attention(model, share_prompt=args.share_prompt)


class MicroBatches:
    """The training sampler of a preference trainer (module docstring).

    Args:
        args: the trainer's config (`padding_free`, `share_prompt`, `max_tokens_per_batch`, sampling).
        row_tokens: a row -> the tokens it occupies in a packed row (`dpo_row_tokens`, `kto_row_tokens`).
        padded_length: a row -> its padded length, for length grouping.
    """

    def __init__(self, args: Any, row_tokens: Callable[[Mapping], int], padded_length: Callable[[Mapping], int]):
        self.args, self.row_tokens, self.padded_length = args, row_tokens, padded_length
        self.budget: TokenBudgetBatchSampler | None = None
        self._planned_for: Any = None  # the dataset the plan was made for

    @property
    def seed(self) -> int:
        return self.args.data_seed if self.args.data_seed is not None else self.args.seed

    def plan(self, dataset: Any, num_processes: int) -> None:
        """Plans the token-budget micro-batches of `dataset` once (called at init, so that a row over
        the budget is refused before training: DataError naming it)."""
        if self.args.max_tokens_per_batch is None or dataset is None:
            return
        self.budget = TokenBudgetBatchSampler(
            [self.row_tokens(row) for row in dataset], self.args.max_tokens_per_batch, num_processes=num_processes,
            seed=self.seed, shuffle=self.args.train_sampling_strategy != "sequential",
        )
        self._planned_for = dataset

    def train_dataloader(self, trainer: Any) -> DataLoader | None:
        """The token-budget DataLoader, prepared by accelerate (None without a budget)."""
        if self.args.max_tokens_per_batch is None:
            return None
        if self._planned_for is not trainer.train_dataset:  # a dataset given after init
            self.plan(trainer.train_dataset, trainer.accelerator.num_processes)
        args = trainer.args
        workers = {}
        if args.dataloader_num_workers:
            workers = dict(num_workers=args.dataloader_num_workers, prefetch_factor=args.dataloader_prefetch_factor,
                           persistent_workers=args.dataloader_persistent_workers)
        loader = DataLoader(trainer.train_dataset, batch_sampler=self.budget, collate_fn=trainer.data_collator,
                            pin_memory=args.dataloader_pin_memory, **workers)
        return trainer.accelerator.prepare(loader)

    def train_sampler(self, dataset: Any, default: Callable[[], Sampler | None]) -> Sampler | None:
        """The length-grouped sampler under `group_by_length`, else the Trainer's own (`default()`)."""
        if self.args.train_sampling_strategy != "group_by_length":
            return default()
        lengths = [self.padded_length(row) for row in dataset]
        return LengthGroupedSampler(lengths, self.args.per_device_train_batch_size, seed=self.seed)

    def eval_sampler(self, dataset: Any, default: Callable[[], Sampler | None]) -> Sampler | None:
        """Evaluation in dataset order under `group_by_length` (the Trainer's grouping needs `input_ids`)."""
        if self.args.train_sampling_strategy != "group_by_length":
            return default()
        return SequentialSampler(dataset) if self.args.world_size <= 1 else None
