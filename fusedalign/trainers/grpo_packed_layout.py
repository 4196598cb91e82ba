"""How one generation's completions become GRPO's packed micro-batches (`padding_free`).

`PackedLayout` holds what a rank generated and the config's packing choices; `plan` cuts the
completions into micro-batches of rows (`data.grpo_packing.plan_micro_batches`), and
`micro_batch` packs one (`data.grpo_packing.pack_completions`) into the typed micro-batch of
`grpo_packed_batch.py`. Used by the rollout's cut (`rollout_cut.py`) for GRPO, RLOO and
distillation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fusedalign.data.grpo_packing import pack_completions, plan_micro_batches, window_chunk
from fusedalign.trainers.grpo_packed_batch import PackedGRPOMicroBatch, PackedGRPOParts, rows_to


@dataclass(frozen=True)
class PackedLayout:
    """How one generation's completions (this rank's) become packed micro-batches (`data.grpo_packing`).

    Attributes:
        prompts, completions: token ids per completion, in the rank's order.
        groups: the prompt group of each completion (its place in the whole generation batch // G).
        share_prompt, budget: the config's `share_prompt` and `max_tokens_per_batch` (None in evaluation).
        chunk: micro-batches between which completions may move (1 in evaluation: one micro-batch).
        keep_membership: the loss is defined per micro-batch (bnpo): completions stay in theirs.
        one_row: a micro-batch is one forward (top_entropy_quantile's threshold): kept as it is.
    """

    prompts: list
    completions: list
    groups: list
    share_prompt: bool
    budget: int | None
    chunk: int
    keep_membership: bool
    one_row: bool

    @classmethod
    def of(cls, args: Any, mode: str, offset: int, prompt_ids: list, out: Any) -> "PackedLayout":
        train = mode == "train"
        G = args.num_generations if train else (args.num_generations_eval or args.num_generations)
        completions = [list(c) for c in out.completion_ids]
        one_row = getattr(args, "top_entropy_quantile", 1.0) < 1.0
        keep = getattr(args, "loss_type", None) == "bnpo" or one_row
        return cls(prompt_ids, completions, [(offset + j) // G for j in range(len(completions))], args.share_prompt,
                   args.max_tokens_per_batch if train else None,
                   window_chunk(args.steps_per_generation, args.gradient_accumulation_steps) if train else 1, keep,
                   one_row)

    def plan(self, order: list[int], micro: int, rows_needed: Any = None) -> list[list[list[int]]]:
        """The micro-batches, each as its rows of completion indices, as many as the padded cut of `order`
        into `micro` (`rows_needed`: as `plan_micro_batches`')."""
        return plan_micro_batches(order, micro, self.chunk, self.groups, [len(p) for p in self.prompts],
                                  [len(c) for c in self.completions], share_prompt=self.share_prompt,
                                  budget=self.budget, keep_membership=self.keep_membership, one_row=self.one_row,
                                  rows_needed=rows_needed)

    def micro_batch(self, rows: list[list[int]], loss_rows: Tensor | None,
                    device: Any) -> PackedGRPOMicroBatch | PackedGRPOParts:
        """The micro-batch of the completions in `rows` (advantages still 0): one packed row, or parts
        of one row each; `loss_rows` [n] bool or None: all."""
        if len(rows) > 1:
            return PackedGRPOParts.of([self.micro_batch([idx], loss_rows, device) for idx in rows])
        idx = rows[0]
        scored = [True] * len(idx) if loss_rows is None else [bool(loss_rows[i]) for i in idx]
        rows, positions = pack_completions([self.prompts[i] for i in idx], [self.completions[i] for i in idx],
                                           [self.groups[i] for i in idx], scored, share_prompt=self.share_prompt)
        return PackedGRPOMicroBatch(rows_to(rows, device), positions.to(device),
                                    torch.zeros(len(idx), device=device))
