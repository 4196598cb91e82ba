"""KTOTrainer: step preparation (reference log-probs, z0) -> labels -> policy log-probs -> KTO loss.

Every forward KTO makes goes through `token_logprobs` (fused by default): the policy on
the completions (with gradient), the policy on the KL pairs (no gradient: z0 is
detached, as in TRL), and the reference on both, in one forward of the completion rows
and the KL rows stacked. The policy's KL rows get their own no-grad forward rather than
riding along with the completions: stacked, they would keep activations and cost
backward work for outputs that are detached anyway. With `padding_free` each of the three
forwards is one packed row (`data/packed_rows.py`): the completions, the KL
partners, and for the reference both in one row, where `share_prompt` computes the prompt
a completion and its KL partner share once.

The KL reference point z0 (KTO paper, Eq. 7) pairs each row with a partner fixed when
the data is prepared (`fusedalign.data.kto`), and is the clamped mean of
log pi(y'|x) - log pi_ref(y'|x) over every pair of the optimizer step: all
micro-batches and all ranks, summed, reduced, then clamped. It is computed in the
step's preparation, before the step's first loss forward. TRL estimates per
micro-batch; over the step the estimate is larger-sample and the same however the global
batch is split, so 2 x b equals 1 x 2b, and 2 ranks equal 1 process, exactly. In
evaluation each batch (all ranks) is its own step.
"""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset
from torch import nn

from fusedalign.configs import KTOConfig
from fusedalign.data.kto import KLPairCollator, add_kl_pairs, stack_kl_rows, unpaired, warn_on_class_balance
from fusedalign.data.packed_rows import PackedRows
from fusedalign.data.preference_batches import PackedKTOCollator, kto_row_tokens
from fusedalign.data.splits import prepare_split
from fusedalign.losses import KTOMetrics, kl_from_sums, kl_sums, kto_batch_loss
from fusedalign.trainers.policy import load_policy
from fusedalign.trainers.preference import PreferenceTrainer
from fusedalign.trainers.preference_inputs import check_models
from fusedalign.trainers.preference_steps import KTOStepBatch, check_step_batch
from fusedalign.trainers.reference import ROW_KEY, load_reference_model, precompute_reference


def _padded_length(row: dict) -> int:
    """An example's length in a padded batch (its KL partner's row is padded with the KL rows)."""
    return len(row["prompt_ids"]) + len(row["completion_ids"])


class KTOTrainer(PreferenceTrainer):
    """Kahneman-Tversky Optimization with the fused output head.

    Args:
        model: A causal LM or a name/path (`builtin:tiny-qwen2`, a directory, a hub id).
        ref_model: A frozen reference model or name/path. Default: loaded from the
            policy's path (or `args.ref_model_name_or_path`); with `peft_config` and none
            given, the policy with its adapter disabled. KTO always needs a reference.
        args: KTOConfig.
        train_dataset, eval_dataset: Unpaired preference data (prompt/completion/label,
            standard or conversational), untokenised or tokenised (`prompt_ids`,
            `completion_ids`, `label`); paired preference data with `args.unpair_preference`.
        processing_class: The tokenizer; default: loaded from the model's path.
        peft_config: A peft LoraConfig to train an adapter instead of the full model.
    """

    def __init__(
        self,
        model: nn.Module | str,
        ref_model: nn.Module | str | None = None,
        args: KTOConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
    ):
        args = args or KTOConfig()
        policy = load_policy(model, args, processing_class, peft_config)
        reference = load_reference_model(ref_model, policy, args, needed=True)
        check_models(args, policy.model, reference)
        train_dataset = self._prepare_split(train_dataset, policy.tokenizer, args, "train")
        if train_dataset is not None:
            warn_on_class_balance(train_dataset["label"], args.desirable_weight, args.undesirable_weight)
        pad, keys, multiple = policy.tokenizer.pad_token_id, args.precompute_ref_log_probs, args.pad_to_multiple_of
        super().__init__(
            model=policy.model, args=args,
            data_collator=PackedKTOCollator(pad, args.share_prompt, multiple, row_keys=keys) if args.padding_free
            else KLPairCollator(pad, row_keys=keys, pad_to_multiple_of=multiple),
            train_dataset=train_dataset, eval_dataset=self._prepare_split(eval_dataset, policy.tokenizer, args, "eval"),
            processing_class=policy.tokenizer, callbacks=callbacks,
        )
        self.setup_preference(policy, reference, needed=True,
                              row_tokens=lambda row: kto_row_tokens(row, args.share_prompt, kl=args.uses_kl),
                              padded_length=_padded_length)

    @staticmethod
    def _prepare_split(dataset: Dataset | None, tokenizer: Any, args: KTOConfig, split: str) -> Dataset | None:
        if dataset is None:
            return None
        dataset = prepare_split(
            "kto", unpaired(dataset, args.unpair_preference, split), tokenizer, split,
            max_length=args.max_length, max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length, truncation_mode=args.truncation_mode,
        )
        if args.uses_kl and "kl_completion_ids" not in dataset.column_names:
            dataset = add_kl_pairs(dataset, args.seed, split)
        return dataset

    # ------------------------------------------------------------------ the step

    def count_items(self, inputs: KTOStepBatch) -> torch.Tensor:
        """Examples with at least one completion token."""
        return (inputs.rows.lengths() > 0).sum()

    def prepare_step(self, model: nn.Module, batches: list[dict[str, Any]], mode: str) -> list[KTOStepBatch]:
        """Each micro-batch of one step as its completions' rows with `ref_logps` [B], and with loss
        type kto the step's z0 as `kl` [].

        z0 sums the KL pairs of every micro-batch here and of every rank, then clamps.
        """
        sums = torch.zeros(2, device=self.accelerator.device)  # sum and count of KL log-ratios
        refs = []
        with torch.no_grad():
            for batch in batches:
                ref, ref_kl = self._reference_pair_logps(model, batch)
                refs.append(ref)
                if self.args.uses_kl:
                    partners = self.rows_of(batch, prefix="kl_")
                    policy_kl = self._completion_logps(model, partners)
                    scored = partners.lengths() > 0
                    sums += torch.stack(kl_sums(policy_kl[scored], ref_kl.to(policy_kl)[scored])).to(sums.device)
        z0 = None
        if self.args.uses_kl:
            sums = self.accelerator.reduce(sums, reduction="sum")
            z0 = kl_from_sums(sums[0], sums[1])
        return [KTOStepBatch(self.rows_of(batch), batch["label"], ref, z0) for batch, ref in zip(batches, refs)]

    def _completion_logps(self, model: nn.Module, rows: PackedRows) -> torch.Tensor:
        """Summed completion log-probs `[S]` of `model`, one per sequence of `rows`."""
        out = self.token_logprobs(model, rows.model_inputs(model), rows.labels)
        return rows.sums(out.logps)

    def _pair_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(completion log-probs `[B]`, KL partner log-probs `[B]`, zeros without KL) of `model`, one forward."""
        if not self.args.uses_kl:
            logps = self._completion_logps(model, self.rows_of(batch))
            return logps, torch.zeros_like(logps)
        if self.args.padding_free:  # both in one row (the prompt once with share_prompt)
            joint = self.rows_of(batch, prefix="joint_", per_group=2)
        else:
            joint = self.rows_of(stack_kl_rows(batch, self.data_collator.pad_token_id), per_group=2)
        return self._completion_logps(model, joint).chunk(2)  # [2B]: completions, then KL partners

    def _reference_pair_logps(self, model: nn.Module,
                              batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's `_pair_logps`: (completion `[B]`, KL partner `[B]`); looked up when precomputed."""
        if self.reference_store is not None:
            if not self.reference_store.ready:
                precompute_reference(self, self.reference_store, lambda b: torch.stack(
                    self.reference.run(model, lambda m: self._pair_logps(m, b)), dim=-1))
            values = self.reference_store.lookup(batch[ROW_KEY])  # [B, 2]
            return values[:, 0], values[:, 1]
        return self.reference.run(model, lambda m: self._pair_logps(m, batch))

    # ------------------------------------------------------------------ loss

    def loss_and_metrics(self, model: nn.Module, inputs: KTOStepBatch, mode: str) -> tuple[torch.Tensor, KTOMetrics]:
        check_step_batch("KTOTrainer", inputs, KTOStepBatch)
        inputs.require(kl=self.args.uses_kl)
        rows = inputs.rows
        # The metrics TRL logs (logits/*, entropy) come from the head's own pass.
        out = self.token_logprobs(model, rows.model_inputs(model), rows.labels, logit_mean=True, entropy=True)
        tokens = rows.lengths()  # [B]
        sums = rows.sums
        # Without a KL term the losses never read z0 (the metrics leave it out): a zero stands in.
        kl = inputs.kl if inputs.kl is not None else inputs.ref_logps.new_zeros(())
        return kto_batch_loss(sums(out.logps), inputs.ref_logps, kl, inputs.desirable, tokens > 0,
                              self.args.loss_options(), logit_sums=sums(out.logit_mean),
                              entropy_sums=sums(out.entropy), tokens=tokens)
