"""The cut of a generation window into micro-batches, and the log-probs fixed at generation.

The rank's completions are shuffled (seeded by the generation's key, as TRL shuffles) and cut
into micro-batches of `per_device_train_batch_size` rows, padded (`completion_batch`) or packed
by prompt (`PackedLayout`, every rank running as many forwards: `_most_rows`); each micro-batch
then gets, in one no-grad pass, the old policy's log-probs (only when the policy changes between
generation and use) and the reference's (only when beta != 0), or, for an advantage strategy
with the KL in the reward, the per-token KL that strategy subtracts. A mixin of `GRPORollout`
(`trainers/grpo_rollout.py`), whose `args`, `accelerator`, `tokenizer`, `advantages`, `score`
and `reference` it reads; `DistillationRollout` replaces `_with_fixed_logps` (nothing fixed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fusedalign.data.grpo import completion_batch
from fusedalign.trainers.grpo_batch import GRPOMicroBatch
from fusedalign.trainers.grpo_packed_layout import PackedLayout
from fusedalign.trainers.step_batch import MicroBatchParts


class RolloutCut:
    """A window's micro-batches, each with the rows it holds and the log-probs its loss needs."""

    def _cut(self, model: Any, rows: list, prompt_ids: list, out: Any, truncated: torch.Tensor, mode: str,
             key: int) -> tuple[list[tuple[GRPOMicroBatch, list[int]]], torch.Tensor | None]:
        """The window's micro-batches (advantages still 0), each with the rows it holds and the
        log-probs its loss needs; and, for a strategy with the KL in the reward and beta != 0,
        the per-token KL [n, T] of this rank's rows in their order (0 off the loss tokens)."""
        args, device = self.args, self.accelerator.device
        loss_rows = ~truncated if args.mask_truncated_completions else None
        order = list(range(len(rows)))
        micro = args.per_device_train_batch_size if mode == "train" else len(rows)
        if len(rows) > micro:  # several micro-batches: decorrelate them (seeded, as TRL shuffles)
            order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed + key + 1)).tolist()
        cuts = [[order[first:first + micro]] for first in range(0, len(rows), micro)]  # each: its rows
        packed = getattr(args, "padding_free", False)
        if packed:  # packed rows: completions regrouped by prompt (data/grpo_packing.py)
            layout = PackedLayout.of(args, mode, self.accelerator.process_index * len(rows), prompt_ids, out)
            cuts = layout.plan(order, micro, self._most_rows)
        batches, kls = [], {}
        for cut in cuts:
            idx = [i for row in cut for i in row]
            if packed:
                batch = layout.micro_batch(cut, loss_rows, device)
            else:
                parts = completion_batch([prompt_ids[i] for i in idx], [out.completion_ids[i] for i in idx],
                                         self.tokenizer.pad_token_id, None if loss_rows is None else loss_rows[idx])
                batch = GRPOMicroBatch(input_ids=parts["input_ids"].to(device),
                                       attention_mask=parts["attention_mask"].to(device), labels=parts["labels"].to(
                                           device), advantages=torch.zeros(len(idx), device=device))
            batch, kl = self._with_fixed_logps(model, batch, mode)
            batches.append((batch, idx))
            if kl is not None:
                kls.update({i: kl[j] for j, i in enumerate(idx)})
        if not kls:
            return batches, None
        width = max(k.shape[0] for k in kls.values())
        return batches, torch.stack([torch.nn.functional.pad(kls[i], (0, width - kls[i].shape[0]))
                                     for i in range(len(rows))])

    def _most_rows(self, rows: list[int]) -> list[int]:
        """The most rows of the budget any rank has in each chunk of its window (every rank runs as many
        forwards)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return rows
        local = torch.tensor(rows, dtype=torch.long, device=acc.device)
        return acc.gather(local).view(acc.num_processes, -1).amax(0).tolist()

    @staticmethod
    def _mask(batches: list, kl: torch.Tensor) -> torch.Tensor:
        """[n, T] the loss tokens of this rank's rows in their order (as `kl`)."""
        mask = torch.zeros(kl.shape, dtype=torch.bool, device=kl.device)
        for batch, idx in batches:
            m = batch.loss_mask
            mask[idx, :m.shape[1]] = m.to(kl.device)
        return mask

    def _with_fixed_logps(self, model: Any, batch: GRPOMicroBatch,
                          mode: str) -> tuple[GRPOMicroBatch, torch.Tensor | None]:
        """Old-policy and reference log-probs [b, T] of a micro-batch, each only when it is needed;
        and the per-token KL [b, T] (policy minus reference on the loss tokens) for a strategy
        with the KL in the reward (else None)."""
        if isinstance(batch, MicroBatchParts):  # each part its own forward
            done = [self._with_fixed_logps(model, part, mode) for part in batch.parts]
            kls = [kl for _, kl in done]
            batch = dataclasses.replace(batch, parts=tuple(part for part, _ in done))
            if kls[0] is None:
                return batch, None
            width = max(kl.shape[1] for kl in kls)
            return batch, torch.cat([torch.nn.functional.pad(kl, (0, width - kl.shape[1])) for kl in kls])
        old = ref = policy = kl = None
        kl_in_reward = self.advantages.kl_in_reward and self.args.beta != 0.0
        score = lambda m: batch.per_completion(self.score(m, *batch.forward_args(m)))  # noqa: E731
        with torch.no_grad():
            if (mode == "train" and self.args.needs_old_logps) or kl_in_reward:
                policy = score(model)
            if mode == "train" and self.args.needs_old_logps:
                old = policy
            if self.args.beta != 0.0:
                ref = self.reference.run(model, score)
            if kl_in_reward:
                kl, ref = (policy - ref) * batch.loss_mask, None
        return batch.replace(old_logps=old, ref_logps=ref), kl
