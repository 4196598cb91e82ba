"""GRPO's rollout: one generation window on this rank, generated, scored, and cut into micro-batches.

Called from the trainer's step preparation, before any forward of the step:

1. generate the completions of the rank's share of the generation batch, on whole weights
   (`fusedalign.distributed.generation_weights`), with the fused head not installed;
2. score them with the reward functions on this rank, gather the rewards of the whole
   generation batch (every rank, in rank order, so groups that span ranks are whole) and
   compute the group-relative advantages, identical on every rank, keeping this rank's;
3. shuffle the rank's completions (seeded) and cut them into `steps_per_generation`
   micro-batches of `per_device_train_batch_size` rows;
4. compute, on exactly those micro-batches, the old policy's log-probs (only when the
   policy changes between generation and use) and the reference's (only when beta != 0).

A row's key is (its dataset row, its index within its group), from its position in the
whole generation batch, so keyed sampling and replay give the same completion to the same
row on any split over ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from fusedalign.data.grpo import completion_batch
from fusedalign.distributed import generation_weights
from fusedalign.head import IGNORE_INDEX
from fusedalign.losses import RewardMetrics, group_advantages
from fusedalign.metrics import Max, Mean, MetricSet, Min, logged_as
from fusedalign.rewards import format_completions, reward_columns


@dataclass(frozen=True)
class CompletionMetrics(MetricSet):
    """Completion lengths (tokens) and the share truncated, per completion, as TRL names them."""

    mean_length: Mean = logged_as("completions/mean_length")
    min_length: Min = logged_as("completions/min_length")
    max_length: Max = logged_as("completions/max_length")
    clipped_ratio: Mean = logged_as("completions/clipped_ratio")
    mean_terminated_length: Mean = logged_as("completions/mean_terminated_length")
    min_terminated_length: Min = logged_as("completions/min_terminated_length")
    max_terminated_length: Max = logged_as("completions/max_terminated_length")
    generation_time: Mean | None = logged_as("generation_time")  # seconds a generation, mean over ranks

    @classmethod
    def of(cls, lengths: torch.Tensor, truncated: torch.Tensor, seconds: float | None = None) -> "CompletionMetrics":
        """From one generation's completion lengths [n], truncation flags [n] and wall time on this rank."""
        n, t = lengths.double(), truncated.bool()
        one, done = torch.ones_like(n), (~t).double()
        inf = torch.full_like(n, float("inf"))
        # Per completion (evaluation drops repeated rows): 1/n of the rank's time, counted 1/n.
        share = torch.full_like(n, 1.0 / max(len(n), 1))
        return cls(
            Mean(n, one), Min(n), Max(n), Mean(t.double(), one), Mean(n * done, done),
            Min(torch.where(t, inf, n)), Max(torch.where(t, -inf, n)),
            None if seconds is None else Mean(share * seconds, share),
        )


class Rollout:
    """The micro-batches of one generation window, served in order, each `uses` times in all."""

    def __init__(self, batches: list[dict[str, Any]], uses: int):
        self.batches, self.uses, self.served = batches, uses, 0

    @property
    def exhausted(self) -> bool:
        return self.served >= len(self.batches) * self.uses

    def next(self) -> dict[str, Any]:
        batch = self.batches[self.served % len(self.batches)]
        self.served += 1
        return batch


def make_rollout(trainer: Any, model: Any, rows: list[dict[str, Any]], mode: str) -> Rollout:
    """Generates, scores and cuts one window of `rows` (this rank's share); see the module docstring."""
    args, acc = trainer.args, trainer.accelerator
    G = args.num_generations if mode == "train" else (args.num_generations_eval or args.num_generations)
    offset = acc.process_index * len(rows)  # the rows' place in the whole generation batch
    keys = [(int(r["row_index"]), (offset + j) % G) for j, r in enumerate(rows)]
    prompt_ids = [list(r["prompt_ids"]) for r in rows]
    start = time.perf_counter()
    with generation_weights(model, acc) as whole:
        out = trainer.generator.generate(whole, prompt_ids, keys, step=trainer.generation_step)
    seconds = time.perf_counter() - start
    trainer.generation_step += 1
    completions = trainer.processing_class.batch_decode(out.completion_ids, skip_special_tokens=True)
    rewards = trainer.reward_funcs(
        [r["prompt"] for r in rows], format_completions(completions, trainer.conversational), out.completion_ids,
        reward_columns(rows), trainer_state=trainer.state,
        row_ids=[f"dataset row {k[0]} (from 0), generation {k[1]}" for k in keys],
    )  # [n, K]
    gathered = acc.gather(rewards.to(acc.device))  # [N, K], rank order = generation-batch order
    adv = group_advantages(gathered, trainer.reward_funcs.weights, G, args.scale_rewards,
                           args.multi_objective_aggregation)
    mine = slice(offset, offset + len(rows))
    advantages, truncated = adv.advantages[mine], torch.tensor(out.truncated)
    lengths = torch.tensor([len(c) for c in out.completion_ids])
    trainer.metrics.record(mode, [
        RewardMetrics.of(rewards, adv.rewards[mine].cpu(), adv.std_is_zero[mine].cpu(), trainer.reward_funcs.names),
        CompletionMetrics.of(lengths, truncated, seconds),
    ])
    loss_rows = ~truncated if args.mask_truncated_completions else None
    order = list(range(len(rows)))
    micro = args.per_device_train_batch_size if mode == "train" else len(rows)
    if len(rows) > micro:  # several micro-batches: decorrelate them (seeded, as TRL shuffles)
        g = torch.Generator().manual_seed(args.seed + trainer.generation_step)
        order = torch.randperm(len(rows), generator=g).tolist()
    batches = []
    for first in range(0, len(rows), micro):
        idx = order[first:first + micro]
        batch = completion_batch([prompt_ids[i] for i in idx], [out.completion_ids[i] for i in idx],
                                 trainer.processing_class.pad_token_id,
                                 None if loss_rows is None else loss_rows[idx])
        batch = {k: v.to(acc.device) for k, v in batch.items()}
        batch["advantages"] = advantages[idx].to(acc.device)
        _add_fixed_logps(trainer, model, batch, mode)
        batches.append(batch)
    uses = args.num_iterations if mode == "train" else 1
    return Rollout(batches, uses)


def _add_fixed_logps(trainer: Any, model: Any, batch: dict[str, Any], mode: str) -> None:
    """Old-policy and reference log-probs [b, T] of a micro-batch, each only when it is needed."""
    args = trainer.args
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        if mode == "train" and args.needs_old_logps:
            batch["old_logps"] = trainer.token_logprobs(model, inputs, batch["labels"]).logps
        if args.beta != 0.0:
            batch["ref_logps"] = trainer.reference.run(
                model, lambda m: trainer.token_logprobs(m, inputs, batch["labels"]).logps)


def loss_mask(batch: dict[str, Any]) -> torch.Tensor:
    """[b, T] bool: the completion tokens in the loss."""
    return batch["labels"] != IGNORE_INDEX
