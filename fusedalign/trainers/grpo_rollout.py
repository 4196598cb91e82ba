"""GRPO's rollout: a component the trainer holds, which owns every piece of generation state.

One generation window on this rank is generated, scored and cut into micro-batches:

1. generate the completions of the rank's share of the generation batch, on whole weights
   (`fusedalign.distributed.generation_weights`), with the fused head not installed;
2. score them with the reward functions on this rank and gather the rewards of the whole
   generation batch (every rank, in rank order, so groups that span ranks are whole);
3. shuffle the rank's completions (seeded) and cut them into `steps_per_generation`
   micro-batches of `per_device_train_batch_size` rows;
4. compute, on exactly those micro-batches, the old policy's log-probs (only when the
   policy changes between generation and use) and the reference's (only when beta != 0)
   (steps 3 and 4: `trainers/rollout_cut.py`);
5. compute the advantages with the trainer's advantage strategy, identical on every rank,
   keeping this rank's: GRPO's group-relative ones (`GroupAdvantages`), or RLOO's
   leave-one-out ones, whose rewards first lose beta x each completion's summed KL to the
   reference (`kl_in_reward`: the policy's and the reference's log-probs of step 4 are then
   always computed, the KL gathered like the rewards, and the reference's log-probs are not
   kept in the micro-batch, whose loss has no KL term).

A row's key is (its dataset row, its index within its group), from its position in the
whole generation batch, so keyed sampling and replay give the same completion to the same
row on any split over ranks. Draws are also keyed by a generation counter, which this
component owns and saves in every checkpoint together with the window being served (its
micro-batches, old-policy and reference log-probs included), so that a run resumed from any
checkpoint, mid-window too, trains exactly as the uninterrupted one.

Evaluation has its own key space (`EVAL_KEYS + global step`, never a training counter) and
its own format (the eval split may be conversational when the train split is not); without
keyed sampling its draws come from RNG states the base forks for evaluation. So evaluation
on or off changes nothing of training.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.utils import logging

from fusedalign.distributed import generation_weights
from fusedalign.losses import GRPOLossMetrics, RewardMetrics
from fusedalign.losses.grpo_metrics import token_mean
from fusedalign.rewards import format_completions, reward_columns, unscored_warning
from fusedalign.trainers.component_states import CheckpointError
from fusedalign.trainers.grpo_batch import GRPOMicroBatch
from fusedalign.trainers.grpo_completions import CompletionLog
from fusedalign.trainers.rollout_cut import RolloutCut
from fusedalign.trainers.rollout_types import (AdvantageStrategy, CompletionMetrics, GroupAdvantages, Scorer, Split,
                                               Window)

logger = logging.get_logger(__name__)

EVAL_KEYS = 2**31  # evaluation's generation keys: EVAL_KEYS + the global step (training's stay below)


class GRPORollout(RolloutCut):
    """Generation, scoring and the training window; see the module docstring.

    Args:
        args: the GRPOConfig.
        generator: a `fusedalign.generation.Generator`.
        reward_funcs: `RewardFunctions`.
        tokenizer: the policy's tokenizer (decoding, padding id).
        accelerator: the Trainer's accelerator (rank, device, gathers).
        metrics: the Trainer's `MetricsRecorder`.
        score: per-token log-probs of a model on a micro-batch (the trainer's `token_logprobs`).
        reference: the Trainer's `Reference` component.
        train_split, eval_split: the formats of the splits (None: no such split).
        advantages: the advantage strategy; default: GRPO's, from args.scale_rewards and
            args.multi_objective_aggregation.
    """

    def __init__(self, args: Any, generator: Any, reward_funcs: Any, tokenizer: Any, accelerator: Any, metrics: Any,
                 score: Scorer, reference: Any, train_split: Split | None, eval_split: Split | None,
                 advantages: AdvantageStrategy | None = None):
        self.advantages = advantages or GroupAdvantages(args.scale_rewards, args.multi_objective_aggregation)
        self.args, self.generator, self.reward_funcs, self.tokenizer = args, generator, reward_funcs, tokenizer
        self.accelerator, self.metrics, self.score, self.reference = accelerator, metrics, score, reference
        self.splits = {"train": train_split, "eval": eval_split}
        self.generations = 0  # training generations so far: the key of the next one's draws
        self.window: Window | None = None
        self.completion_log = CompletionLog(args.log_completions, accelerator)

    # ------------------------------------------------------------------ serving

    def train_batch(self, model: Any, rows: list[dict[str, Any]], trainer_state: Any) -> GRPOMicroBatch:
        """The next micro-batch of the window, generating a new window at its start."""
        if self.window is None or self.window.exhausted:
            batches = self._generate(model, rows, "train", self.generations, trainer_state)
            self.generations += 1
            self.window = Window(batches, self.args.num_iterations)
        return self.window.next().to(self.accelerator.device)

    def eval_batch(self, model: Any, rows: list[dict[str, Any]], trainer_state: Any) -> GRPOMicroBatch:
        """One evaluation batch as a single micro-batch; no training state is read or changed (the
        base evaluates on forked RNG states)."""
        return self._generate(model, rows, "eval", EVAL_KEYS + trainer_state.global_step, trainer_state)[0]

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        window = None
        if self.window is not None and not self.window.exhausted:
            window = {"batches": [b.state() for b in self.window.batches], "uses": self.window.uses,
                      "served": self.window.served}
        return {"generations": self.generations, "window": window}

    def load_state_dict(self, state: dict[str, Any], same_ranks: bool = True) -> None:
        if state.get("window") is not None and not same_ranks:
            raise CheckpointError(
                "this checkpoint was written in the middle of a generation window by another number of "
                "processes, whose completions were split over those ranks; resume it with the same number of "
                "processes, or from a checkpoint at the end of a window (save_steps a multiple of "
                "steps_per_generation x num_iterations / gradient_accumulation_steps)")
        self.generations = int(state["generations"])
        window = state.get("window")
        self.window = None if window is None else Window(
            [GRPOMicroBatch.from_state(b) for b in window["batches"]], int(window["uses"]), int(window["served"]))

    # ------------------------------------------------------------------ one window

    def _generate(self, model: Any, rows: list[dict[str, Any]], mode: str, key: int,
                  trainer_state: Any) -> list[GRPOMicroBatch]:
        """Generates, scores and cuts `rows` (this rank's share); see the module docstring."""
        args, acc = self.args, self.accelerator
        G = args.num_generations if mode == "train" else (args.num_generations_eval or args.num_generations)
        offset = acc.process_index * len(rows)  # the rows' place in the whole generation batch
        keys = [(int(r["row_index"]), (offset + j) % G) for j, r in enumerate(rows)]
        prompt_ids = [list(r["prompt_ids"]) for r in rows]
        start = time.perf_counter()
        with generation_weights(model, acc) as whole:
            out = self.generator.generate(whole, prompt_ids, keys, step=key)
        seconds = time.perf_counter() - start
        completions = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        row_ids = [f"dataset row {k[0]} (from 0), generation {k[1]}" for k in keys]
        rewards = self.reward_funcs(
            [r["prompt"] for r in rows], format_completions(completions, self.splits[mode].conversational),
            out.completion_ids, reward_columns(rows), trainer_state=trainer_state, row_ids=row_ids,
        )  # [n, K]
        gathered = acc.gather(rewards.to(acc.device))  # [N, K], rank order = generation-batch order
        if acc.is_main_process:
            self._warn_unscored(gathered, rewards, row_ids, mode, trainer_state)
        truncated = torch.tensor(out.truncated)
        batches, kl = self._cut(model, rows, prompt_ids, out, truncated, mode, key)
        sequence_kl = None if kl is None else acc.gather(kl.sum(-1).to(acc.device))  # [N]
        adv = self.advantages(gathered, self.reward_funcs.weights, G, sequence_kl)
        mine = slice(offset, offset + len(rows))
        advantages = adv.advantages[mine]
        lengths = torch.tensor([len(c) for c in out.completion_ids])
        recorded = [RewardMetrics.of(rewards, adv.rewards[mine].cpu(), adv.std_is_zero[mine].cpu(),
                                     self.reward_funcs.names), CompletionMetrics.of(lengths, truncated, seconds)]
        if kl is not None:  # TRL logs the KL in the reward as `kl`: its mean over the loss tokens
            recorded.append(GRPOLossMetrics(kl=token_mean(kl, self._mask(batches, kl))))
        self.metrics.record(mode, recorded)
        if mode == "train":
            self.completion_log.add(trainer_state.global_step + 1, [r["prompt"] for r in rows], completions,
                                    rewards, self.reward_funcs.names, advantages)
        return [b.replace(advantages=advantages[idx].to(b.loss_mask.device)) for b, idx in batches]

    def _warn_unscored(self, gathered: torch.Tensor, rewards: torch.Tensor, row_ids: list[str], mode: str,
                       trainer_state: Any) -> None:
        """Warns when every reward function returned None or NaN for some completions of the generation
        batch (`gathered` [N, K]; `rewards` [n, K] this rank's, to name one of them)."""
        where = (f"step {trainer_state.global_step + 1}" if mode == "train"
                 else f"evaluation at step {trainer_state.global_step}")
        mine = torch.isnan(rewards).all(dim=1).nonzero().flatten().tolist()
        message = unscored_warning(gathered.cpu(), self.reward_funcs.names, where, row_ids[mine[0]] if mine else None)
        if message:
            logger.warning(message)
