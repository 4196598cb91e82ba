"""GRPO's data: the sampler of generation batches, and completions laid out as training rows.

A dataloader item is one rank's share of a generation batch: `per_device_train_batch_size
x steps_per_generation` prompt rows, each prompt of the generation batch repeated
`num_generations` times, contiguously. `GenerationBatchSampler` yields the whole generation
batch (all ranks' shares, in rank order, as accelerate deals consecutive batches to ranks)
`steps_per_generation x num_iterations` times in a row, so that every micro-step gets an
item and the trainer generates on the first item of each window and serves the stored
completions on the others (TRL's layout: the same seed on every rank, a prompt's group may
span ranks, so rewards are gathered before the advantages). Completions are then laid out
as right-padded `prompt + completion` rows with position-aligned labels on the completion.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from .collators import pad, position_labels


class GenerationBatchSampler(Sampler[int]):
    """Row indices: each generation batch's prompts, each repeated G times, the batch repeated.

    Args:
        num_rows: rows of the prompt dataset.
        num_generations: G, completions per prompt.
        prompts_per_batch: distinct prompts in one generation batch (generation_batch_size / G).
        repeats: how many times each generation batch is yielded (steps_per_generation x
            num_iterations): one item per micro-step of its window.
        shuffle: draw the prompts in a random order (seeded, the same on every rank).
        seed: the order's seed; `set_epoch` changes it per epoch.
        batch_flags: the flags that size a generation batch, named when the dataset is too small for one.

    Prompts that do not fill a last generation batch are left out of that epoch.
    """

    def __init__(self, num_rows: int, num_generations: int, prompts_per_batch: int, repeats: int = 1, *,
                 shuffle: bool = True, seed: int = 0,
                 batch_flags: str = "per_device_train_batch_size or steps_per_generation"):
        if prompts_per_batch < 1 or num_rows < prompts_per_batch:
            raise ValueError(f"a generation batch needs {prompts_per_batch} distinct prompts but the dataset has "
                             f"{num_rows} rows; lower {batch_flags}, or add rows")
        self.num_rows, self.G, self.per_batch, self.repeats = num_rows, num_generations, prompts_per_batch, repeats
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (self.num_rows // self.per_batch) * self.per_batch * self.G * self.repeats

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + self.epoch))
            order = order.tolist()
        else:
            order = list(range(self.num_rows))
        for start in range(0, len(order) - self.per_batch + 1, self.per_batch):
            batch = [row for row in order[start:start + self.per_batch] for _ in range(self.G)]
            for _ in range(self.repeats):
                yield from batch


def collate_rows(features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A GRPO dataloader item: the prompt rows as they are (generation happens in step preparation)."""
    return {"rows": [dict(f) for f in features]}


def completion_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                     pad_token_id: int, loss_rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Training rows `prompt + completion`, right-padded.

    Args:
        prompt_ids, completion_ids: per row.
        loss_rows: [B] bool, rows whose completion enters the loss (False: masked, e.g. a
            truncated completion with mask_truncated_completions); default all.

    Returns:
        input_ids, attention_mask, completion_mask [B, T]; labels [B, T] (the completion
        token predicted at each position, -100 elsewhere and on masked rows).
    """
    ids = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    masks = [[0] * len(p) + [1] * len(c) for p, c in zip(prompt_ids, completion_ids)]
    batch = {
        "input_ids": pad(ids, pad_token_id),
        "attention_mask": pad([[1] * len(s) for s in ids], 0),
        "completion_mask": pad(masks, 0),
    }
    if loss_rows is not None:
        batch["completion_mask"] = batch["completion_mask"] * loss_rows.long()[:, None]
    batch["labels"] = position_labels(batch["input_ids"], batch["completion_mask"])
    return batch
