"""How the DPO and KTO trainers read and sample their micro-batches: padded or packed rows.

Two layouts behind one interface (`RowLayout`), so that a trainer reads its batches the
same way whichever it gets:

- padded (`DPOCollator`, `KLPairCollator`): one sequence a row, an `attention_mask`,
  labels from `position_labels`;
- packed (`padding_free`: `PackedDPOCollator`, `PackedKTOCollator`, see
  `fusedalign.data.preference_batches`): one row `[1, L]` of many sequences, its labels,
  `sequence_ids` and `scored_tokens` made by the collator, attention confined to each
  sequence by `fusedalign.attention.attention_inputs` (a mask with `share_prompt`).

Either way per-sequence values come back `[S]` in the same order (DPO: chosen 0..B-1, then
rejected; KTO: completions, or in the joint row completions then KL partners), summed in
fp64 and rounded once, as the loss-aware head sums.

A packed row's forward arguments are built once per row and model and kept in the batch
(`ATTENTION`), so the reference's forward in the step's preparation and the policy's later
share them (an sdpa or eager mask is L x L booleans; long shared rows belong on flex
attention, whose `BlockMask` is small). Models that mask differently (another attention
implementation, window or class) each get their own.

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

from fusedalign.attention import attention_inputs, check_preference_attention, layer_windows
from fusedalign.data import position_labels
from fusedalign.data.preference_batches import sequence_logps
from fusedalign.data.samplers import LengthGroupedSampler, TokenBudgetBatchSampler
from fusedalign.head import IGNORE_INDEX, RowLoss, unwrap_model

ATTENTION = "_attention_inputs"  # {(prefix, mask signature): forward kwargs} of a packed batch
ROW_INPUTS = ("input_ids", "position_ids", "segment_ids", "parent_ids")


def check_models(args: Any, *models: nn.Module | None) -> None:
    """At the trainer's init: refuses a policy or reference that cannot isolate packed sequences."""
    if args.padding_free:
        for model in models:
            if model is not None:
                check_preference_attention(model, share_prompt=args.share_prompt)


def _mask_signature(model: nn.Module) -> tuple:
    """What a packed row's forward arguments depend on, besides the row."""
    lm = unwrap_model(model)
    return (type(lm), lm.config._attn_implementation, tuple(layer_windows(lm).items()),
            lm.get_input_embeddings().weight.dtype)


class RowLayout:
    """Reads one layout's micro-batches; `prefix` picks a trainer's other rows (KTO's `kl_`, `joint_`)."""

    def __init__(self, packed: bool):
        self.packed = packed

    def labels(self, batch: Mapping[str, Any], prefix: str = "") -> torch.Tensor:
        """Position-aligned labels [R, T] (packed: [1, L])."""
        if self.packed:
            return batch[prefix + "labels"]
        return position_labels(batch[prefix + "input_ids"], batch[prefix + "completion_mask"])

    def lengths(self, batch: Mapping[str, Any], prefix: str = "") -> torch.Tensor:
        """Scored tokens of each sequence [S]."""
        if self.packed:
            return batch[prefix + "scored_tokens"]
        return (self.labels(batch, prefix) != IGNORE_INDEX).sum(-1)

    def num_sequences(self, batch: Mapping[str, Any], prefix: str = "") -> int:
        """S, the number of sequences the batch holds (from shapes alone)."""
        if self.packed:
            return batch[prefix + "scored_tokens"].shape[0]
        return batch[prefix + "input_ids"].shape[0]

    def sums(self, values: torch.Tensor, batch: Mapping[str, Any], prefix: str = "") -> torch.Tensor:
        """Per-sequence sums [S] of per-position values [R, T] (0 where unscored), in fp64, rounded once
        to the values' dtype (float32 for booleans); differentiable."""
        values = values if values.is_floating_point() else values.float()
        if not self.packed:
            return values.double().sum(-1).to(values.dtype)
        return sequence_logps(values, {"sequence_ids": batch[prefix + "sequence_ids"],
                                       "scored_tokens": batch[prefix + "scored_tokens"]})

    def model_inputs(self, model: nn.Module, batch: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        """The forward's keyword arguments; packed: built once per row and model (module docstring)."""
        if not self.packed:
            return {"input_ids": batch[prefix + "input_ids"], "attention_mask": batch[prefix + "attention_mask"]}
        cache = batch.setdefault(ATTENTION, {})
        key = (prefix, _mask_signature(model))
        if key not in cache:
            cache[key] = attention_inputs(model, {k: batch[prefix + k] for k in ROW_INPUTS})
        return cache[key]

    def row_loss(self, batch: Mapping[str, Any], grad: Callable) -> RowLoss:
        """The loss-aware head's declaration: each DPO pair (its two sequences) one group."""
        if self.packed:
            return RowLoss(batch["sequence_pair"], grad, segments=batch["sequence_ids"])
        pair = torch.arange(batch["input_ids"].shape[0] // 2, device=batch["input_ids"].device)
        return RowLoss(torch.cat([pair, pair]), grad)

    def input_tokens(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Tokens of the batch's sequences as padded rows hold them (TRL's `num_tokens`, whatever the layout)."""
        if self.packed:
            return batch["sequence_tokens"].sum()
        return batch["attention_mask"].sum()


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
