"""DPOTrainer: step preparation (reference log-probs) -> labels -> policy log-probs -> DPO loss.

Chosen and rejected completions go through the policy in one forward (padded: rows `[:B]`
chosen, `[B:]` rejected; `padding_free`: one row holding every sequence, `share_prompt`:
each prompt once; one layout either way, `data/packed_rows.py`); the reference, in whichever mode,
likewise, in the same layout, once per micro-batch in the step's preparation, before any
policy forward: with the reference known, the policy's head can form its gradient in its
own forward (the loss-aware head). Either way the trainer sees per-sequence sums `[2B]`, or
under LD-DPO (`ld_alpha`) each sequence's sums within and past its pair's shared length `[4B]`
(`data/shared_length.py`), which the loss weighs: plain sums, so the loss-aware head still
declares its loss, and the reference's are weighted by the same cut. Under WPO (`use_weighting`)
each pair's loss is weighed by statistics of the policy's own forward (`losses/dpo_weighting.py`),
so that loss is not known before the forward: the per-token op runs, then the loss.
"""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset
from torch import nn

from fusedalign.configs import DPOConfig
from fusedalign.data import DPOCollator
from fusedalign.data.packed_rows import PackedRows
from fusedalign.data.preference_batches import PackedDPOCollator, dpo_row_tokens
from fusedalign.data.shared_length import SharedLengthSplit
from fusedalign.data.splits import prepare_split
from fusedalign.losses import (
    RunningRewardMean,
    bco_reward_mean,
    dpo_batch_loss,
    ld_weighted,
    pair_loss_gradient,
    pairwise_dpo_losses,
    valid_pairs,
    wpo_weights,
)
from fusedalign.losses.dpo_metrics import DPOMetrics
from fusedalign.trainers.policy import load_policy
from fusedalign.trainers.preference import PreferenceTrainer
from fusedalign.trainers.preference_inputs import check_models
from fusedalign.trainers.preference_steps import DPOStepBatch, check_step_batch, chosen_tokens_per_pair
from fusedalign.trainers.reference import ROW_KEY, load_reference_model, precompute_reference


def _padded_length(row: dict) -> int:
    """A pair's length in a padded batch (its two rows are padded to the same length)."""
    return len(row["prompt_ids"]) + max(len(row["chosen_ids"]), len(row["rejected_ids"]))


class DPOTrainer(PreferenceTrainer):
    """Direct Preference Optimization with the fused output head.

    Args:
        model: A causal LM or a name/path (`builtin:tiny-qwen2`, a directory, a hub id).
        ref_model: A frozen reference model or name/path. Default: loaded from the
            policy's path; with `peft_config` and none given, the policy with its adapter
            disabled; with `args.reference_free`, none.
        args: DPOConfig.
        train_dataset, eval_dataset: Preference data (prompt/chosen/rejected, standard or
            conversational, or implicit-prompt chosen/rejected), or already tokenised rows
            (`prompt_ids`, `chosen_ids`, `rejected_ids`), used as they are.
        processing_class: The tokenizer; default: loaded from the model's path.
        peft_config: A peft LoraConfig to train an adapter instead of the full model.
    """

    def __init__(
        self,
        model: nn.Module | str,
        ref_model: nn.Module | str | None = None,
        args: DPOConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
    ):
        args = args or DPOConfig()
        policy = load_policy(model, args, processing_class, peft_config)
        reference = load_reference_model(ref_model, policy, args, needed=not args.reference_free)
        check_models(args, policy.model, reference)
        tokenize = dict(max_length=args.max_length, max_prompt_length=args.max_prompt_length,
                        truncation_mode=args.truncation_mode)
        pad, keys, multiple = policy.tokenizer.pad_token_id, args.precompute_ref_log_probs, args.pad_to_multiple_of
        super().__init__(
            model=policy.model, args=args,
            data_collator=PackedDPOCollator(pad, args.share_prompt, multiple, row_keys=keys) if args.padding_free
            else DPOCollator(pad, multiple, row_keys=keys),
            train_dataset=prepare_split("dpo", train_dataset, policy.tokenizer, "train", **tokenize),
            eval_dataset=prepare_split("dpo", eval_dataset, policy.tokenizer, "eval", **tokenize),
            processing_class=policy.tokenizer, callbacks=callbacks,
        )
        self.setup_preference(policy, reference, needed=not args.reference_free,
                              row_tokens=lambda row: dpo_row_tokens(row, args.share_prompt),
                              padded_length=_padded_length)
        self.bco_shift = None
        if "bco_pair" in args.loss_type and args.bco_running_mean:
            self.bco_shift = self.checkpointed("bco_running_mean", RunningRewardMean())

    # ------------------------------------------------------------------ the step

    def count_items(self, inputs: DPOStepBatch) -> torch.Tensor:
        """Pairs whose chosen and rejected both keep at least one completion token."""
        return valid_pairs(inputs.rows.lengths()).sum()

    def prepare_step(self, model: nn.Module, batches: list[dict[str, Any]], mode: str) -> list[DPOStepBatch]:
        """Each micro-batch as its rows with `ref_logps` [2B], the reference's sequence log-probs, for
        the sft term the step's chosen tokens per pair (all micro-batches and ranks), and under LD-DPO
        the rows' cut at each pair's shared length."""
        rows = [self.rows_of(batch, per_group=2) for batch in batches]
        splits = [self._ld_split(r) for r in rows]
        refs = [self._reference_chosen_rejected_logps(model, b, r, s).detach()
                for b, r, s in zip(batches, rows, splits)]
        per_pair = None
        if "sft" in self.args.loss_type:
            per_pair = chosen_tokens_per_pair(rows, self.accelerator.device,
                                              lambda t: self.accelerator.reduce(t, reduction="sum"))
        return [DPOStepBatch(r, ref, per_pair, s) for r, ref, s in zip(rows, refs, splits)]

    def _ld_split(self, rows: PackedRows) -> SharedLengthSplit | None:
        return None if self.args.ld_weight is None else SharedLengthSplit.of(rows)

    def _chosen_rejected_logps(self, model: nn.Module, rows: PackedRows,
                               split: SharedLengthSplit | None) -> torch.Tensor:
        """Summed completion log-probs of `model`, `[2B]`: the B chosen, then the B rejected (LD-weighted
        with a `split`)."""
        out = self.token_logprobs(model, rows.model_inputs(model), rows.labels)
        # Summed in fp64 and rounded once, as the policy's are: equal models give equal sums.
        if split is None:
            return rows.sums(out.logps)  # [2B]
        return ld_weighted(split.sums(out.logps), self.args.ld_weight).weighted  # [2B]

    def _reference_chosen_rejected_logps(self, model: nn.Module, batch: dict[str, torch.Tensor],
                                         rows: PackedRows, split: SharedLengthSplit | None) -> torch.Tensor:
        """The reference's `_chosen_rejected_logps` of a batch's rows, `[2B]` (zeros when reference-free;
        looked up by the batch's row keys when precomputed)."""
        if self.args.reference_free:
            return torch.zeros(rows.num_sequences, device=rows.input_ids.device)
        if self.reference_store is not None:
            if not self.reference_store.ready:
                precompute_reference(self, self.reference_store, lambda b: self._reference_pairs(model, b))
            values = self.reference_store.lookup(batch[ROW_KEY])  # [B, 2]
            return torch.cat([values[:, 0], values[:, 1]])
        return self.reference.run(model, lambda m: self._chosen_rejected_logps(m, rows, split))

    def _reference_pairs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Reference log-probs of a batch, `[B, 2]`: chosen, rejected (the rows of the precomputed store)."""
        rows = self.rows_of(batch, per_group=2)
        logps = self.reference.run(model, lambda m: self._chosen_rejected_logps(m, rows, self._ld_split(rows)))
        return torch.stack(logps.chunk(2), dim=-1)

    # ------------------------------------------------------------------ loss

    def loss_and_metrics(self, model: nn.Module, inputs: DPOStepBatch, mode: str) -> tuple[torch.Tensor, DPOMetrics]:
        args = self.args
        check_step_batch("DPOTrainer", inputs, DPOStepBatch)
        inputs.require(sft="sft" in args.loss_type, ld=args.ld_weight is not None)
        rows, ref, sft_divisor, split = inputs.rows, inputs.ref_logps, inputs.sft_tokens_per_pair, inputs.ld_split
        labels, lengths, alpha = rows.labels, rows.lengths(), args.ld_weight
        opts = args.loss_options(self.bco_shift.delta if self.bco_shift is not None else 0.0, sft_divisor)
        row_loss = None
        if self._loss_aware(mode):
            grad = pair_loss_gradient(ref, lengths, args.loss_plan, opts, alpha)
            row_loss = rows.row_loss(grad) if split is None else split.row_loss(grad)
        out = self.token_logprobs(model, rows.model_inputs(model), labels, logit_mean=True, entropy=True,
                                  argmax=True, log_sum_sq_probs=args.use_weighting, row_loss=row_loss)
        # Summed in fp64 (then rounded once): the loss-aware head sums the same log-probs the
        # same way, so the loss it predicts is the loss computed here.
        seq = rows.sums(out.logps) if split is None else split.sums(out.logps)  # [2B], or [4B] parts (LD-DPO)
        if self.bco_shift is not None and mode == "train":
            # BCO's reward shift: a running mean over every reward seen, this batch included.
            scored = seq if split is None else ld_weighted(seq, alpha).weighted
            self._update_bco_shift(args.beta * (scored.detach() - ref.to(seq.dtype)))
            opts = args.loss_options(self.bco_shift.delta, sft_divisor)
        # WPO: every scored token counts once, whatever LD-DPO weighs (as TRL's weights).
        weights = wpo_weights(rows.sums(out.logps.detach() - out.log_sum_sq_probs), lengths) \
            if args.use_weighting else None
        # The metrics TRL logs, from the head's own pass (0 on positions without a label).
        return dpo_batch_loss(seq, ref, lengths, args.loss_plan, opts, logit_sums=rows.sums(out.logit_mean),
                              entropy_sums=rows.sums(out.entropy), correct=rows.sums(out.argmax_match), ld_alpha=alpha,
                              pair_weights=weights)

    def _loss_aware(self, mode: str) -> bool:
        """Whether the policy's head may form its gradient in the forward: fused, training,
        and every loss type a function of its own pair alone (not aot's batch sort, not
        bco_pair's optional running mean, which is updated from this very batch), known before
        the forward (not WPO's, weighed by that forward's own statistics)."""
        args = self.args
        return (args.fused_head and args.loss_aware_head and mode == "train" and torch.is_grad_enabled()
                and pairwise_dpo_losses(args.loss_type, args.bco_running_mean) and not args.use_weighting)

    def _update_bco_shift(self, rewards: torch.Tensor) -> None:
        half = rewards.shape[0] // 2
        batch = bco_reward_mean(rewards[:half], rewards[half:])
        total = self.accelerator.reduce(torch.stack([batch.sum, batch.count]).float(), reduction="sum").tolist()
        self.bco_shift.update(*total)
