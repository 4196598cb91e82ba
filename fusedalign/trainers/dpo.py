"""DPOTrainer: batch -> labels -> log-probs (fused or not) -> DPO loss -> metrics.

Chosen and rejected completions go through the policy in one forward (rows `[:B]` are
chosen, `[B:]` rejected); the reference model, in whichever mode, likewise.
"""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset
from torch import nn

from fusedalign.configs import DPOConfig
from fusedalign.data import DPOCollator, position_labels, prepare_dpo_dataset
from fusedalign.head import IGNORE_INDEX, RowLoss
from fusedalign.losses import bco_reward_mean, check_dpo_args, dpo_losses, pairwise_dpo_losses
from fusedalign.trainers.base import FusedAlignTrainer, Metrics
from fusedalign.trainers.common import prepare_models, tokenize_split
from fusedalign.trainers.reference import PrecomputedReferenceMixin


class DPOTrainer(PrecomputedReferenceMixin, FusedAlignTrainer):
    """Direct Preference Optimization with the fused output head.

    Args:
        model: A causal LM or a name/path (`builtin:tiny-qwen2`, a directory, a hub id).
        ref_model: A frozen reference model or name/path. Default: loaded from the
            policy's path; with `peft_config` and none given, the policy with its adapter
            disabled; with `args.reference_free`, none.
        args: DPOConfig.
        train_dataset, eval_dataset: Preference data (prompt/chosen/rejected, standard or
            conversational, or implicit-prompt chosen/rejected), untokenised.
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
        check_dpo_args(args.loss_type, beta=args.beta, label_smoothing=args.label_smoothing, loss_weights=args.loss_weights)
        models = prepare_models(model, ref_model, args, processing_class, peft_config, reference=not args.reference_free)
        tokenizer = models.tokenizer
        tokenize = dict(
            max_length=args.max_length, max_prompt_length=args.max_prompt_length, truncation_mode=args.truncation_mode
        )
        train_dataset = tokenize_split(prepare_dpo_dataset, train_dataset, tokenizer, "train", **tokenize)
        eval_dataset = tokenize_split(prepare_dpo_dataset, eval_dataset, tokenizer, "eval", **tokenize)
        collator = DPOCollator(pad_token_id=tokenizer.pad_token_id)
        super().__init__(
            model=models.model, args=args, data_collator=collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=tokenizer, callbacks=callbacks,
        )
        self.setup_reference(models.ref_model, is_peft=models.is_peft)
        self._bco_delta = torch.zeros(())
        self._bco_seen = torch.zeros(2)  # sum and count of all rewards seen (all ranks)

    # ------------------------------------------------------------------ counting

    @staticmethod
    def _labels(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return position_labels(inputs["input_ids"], inputs["completion_mask"])  # [2B, T]

    def count_items(self, inputs: dict[str, Any]) -> torch.Tensor:
        """Pairs whose chosen and rejected both keep at least one completion token."""
        return self._valid_pairs(self._labels(inputs)).sum()

    @staticmethod
    def _valid_pairs(labels: torch.Tensor) -> torch.Tensor:
        lengths = (labels != IGNORE_INDEX).sum(-1)
        half = lengths.shape[0] // 2
        return (lengths[:half] > 0) & (lengths[half:] > 0)  # [B]

    # ------------------------------------------------------------------ reference

    def _sequence_logps(self, model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        model_inputs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        out = self.token_logprobs(model, model_inputs, labels)
        return out.logps.sum(-1)  # [2B]

    def _reference_logps(self, model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor, mode: str) -> torch.Tensor:
        rows = labels.shape[0]
        if self.args.reference_free:
            return torch.zeros(rows, device=labels.device)
        if self.args.precompute_ref_log_probs:
            values = self.precomputed_reference(model, inputs["index"], mode, self._reference_rows)  # [B, 2]
            return torch.cat([values[:, 0], values[:, 1]]).to(labels.device)
        return self.reference.run(model, lambda m: self._sequence_logps(m, inputs, labels))

    def _reference_rows(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Reference log-probs of a batch, `[B, 2]`: chosen, rejected (for precomputing)."""
        labels = self._labels(batch)
        logps = self.reference.run(model, lambda m: self._sequence_logps(m, batch, labels))
        return torch.stack(logps.chunk(2), dim=-1)

    # ------------------------------------------------------------------ loss

    def loss_and_metrics(self, model: nn.Module, inputs: dict[str, Any], mode: str) -> tuple[torch.Tensor, Metrics]:
        args = self.args
        labels = self._labels(inputs)
        model_inputs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        mask = labels != IGNORE_INDEX  # [2B, T]
        lengths = mask.sum(-1)
        valid = self._valid_pairs(labels).float()  # [B]
        # The reference first: with it known, the policy's head can form its gradient in
        # its own forward (the loss-aware head).
        ref = self._reference_logps(model, inputs, labels, mode).detach()
        row_loss = self._row_loss(ref, lengths, valid) if self._loss_aware(mode) else None
        out = self.token_logprobs(model, model_inputs, labels, logit_mean=True, row_loss=row_loss)
        # Summed in fp64 (then rounded once): the loss-aware head sums the same log-probs the
        # same way, so the loss it predicts is the loss computed here.
        seq = out.logps.double().sum(-1).to(out.logps.dtype)  # [2B]
        half = seq.shape[0] // 2
        if "bco_pair" in args.loss_type and mode == "train":
            # BCO's reward shift: a running mean over every reward seen, this batch included.
            self._update_bco_delta(args.beta * (seq - ref).detach()[:half], args.beta * (seq - ref).detach()[half:])
        result = self._pair_losses(seq, ref, lengths)
        # Pairs with nothing to score contribute zero but stay in the graph.
        loss_sum = (result.losses * valid).sum()
        return loss_sum, self._metrics(result, seq.detach(), out.logit_mean, mask, valid)

    def _pair_losses(self, seq: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor):
        """Per-pair losses [B] from the policy's and reference's sequence log-probs [2B]."""
        args, half = self.args, seq.shape[0] // 2
        return dpo_losses(
            seq[:half], seq[half:], ref[:half], ref[half:],
            loss_type=args.loss_type, beta=args.beta, label_smoothing=args.label_smoothing,
            loss_weights=args.loss_weights, chosen_lengths=lengths[:half].clamp(min=1),
            rejected_lengths=lengths[half:].clamp(min=1), bco_delta=self._bco_delta.to(seq.device),
            discopop_tau=args.discopop_tau,
        )

    def _loss_aware(self, mode: str) -> bool:
        """Whether the policy's head may form its gradient in the forward: fused, training,
        and every loss type a function of its own pair alone (not aot's batch sort, not
        bco_pair's running mean, which is updated from this very batch)."""
        args = self.args
        return (args.fused_head and args.loss_aware_head and mode == "train" and torch.is_grad_enabled()
                and pairwise_dpo_losses(args.loss_type))

    def _row_loss(self, ref: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor) -> RowLoss:
        """The loss as the head needs it: d(sum of valid pair losses)/d(row sums), each pair its own group."""
        half = ref.shape[0] // 2

        def grad(sums: torch.Tensor) -> torch.Tensor:
            sums = sums.detach().requires_grad_()
            losses = self._pair_losses(sums, ref.to(sums.dtype), lengths).losses
            return torch.autograd.grad((losses * valid.to(sums.dtype)).sum(), sums)[0]

        pair = torch.arange(half, device=ref.device)
        return RowLoss(groups=torch.cat([pair, pair]), grad=grad)

    def _update_bco_delta(self, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> None:
        batch = bco_reward_mean(chosen_rewards, rejected_rewards)
        total = self.accelerator.reduce(torch.stack([batch.sum, batch.count]).float(), reduction="sum").cpu()
        self._bco_seen += total
        self._bco_delta = self._bco_seen[0] / self._bco_seen[1].clamp(min=1)

    @staticmethod
    def _metrics(result, seq, logit_mean, mask, valid) -> Metrics:
        """Per-pair sums and counts ([B] each), so evaluation can drop padded duplicates."""
        half = seq.shape[0] // 2
        chosen, rejected = result.chosen_rewards, result.rejected_rewards
        tokens_c, tokens_r = mask[:half].sum(-1).double(), mask[half:].sum(-1).double()  # [B]
        zeros = torch.zeros_like(tokens_c)
        logits_c = (logit_mean[:half] * mask[:half]).sum(-1) if logit_mean is not None else zeros
        logits_r = (logit_mean[half:] * mask[half:]).sum(-1) if logit_mean is not None else zeros
        return {
            "rewards/chosen": (chosen * valid, valid),
            "rewards/rejected": (rejected * valid, valid),
            "rewards/accuracies": ((chosen > rejected).float() * valid, valid),
            "rewards/margins": ((chosen - rejected) * valid, valid),
            "logps/chosen": (seq[:half] * valid, valid),
            "logps/rejected": (seq[half:] * valid, valid),
            "logits/chosen": (logits_c, tokens_c),
            "logits/rejected": (logits_r, tokens_r),
        }
