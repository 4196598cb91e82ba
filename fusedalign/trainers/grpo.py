"""GRPOTrainer: step preparation (generate, score, advantages) -> policy log-probs -> GRPO loss.

Generation happens in the trainer's step preparation, once per generation window, before
any forward of the step, by the rollout component the trainer holds
(`trainers/grpo_rollout.py`), which owns the generation state and saves it in every
checkpoint; it returns typed micro-batches (`trainers/grpo_batch.py`; with `padding_free`,
packed rows read back per completion, `trainers/grpo_packed_batch.py`). The policy, old-policy and reference
log-probs all come from `token_logprobs`, i.e. from the fused head inside `lm_head`'s own
forward, entropy in the same pass. The base normalises each micro-batch's loss sum by the
loss type's items over the whole optimizer step and every rank (`losses/grpo.py` gives the
table against TRL 1.16).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from datasets import Dataset
from torch import nn

from fusedalign.configs import GRPOConfig
from fusedalign.data.grpo import collate_rows
from fusedalign.data.grpo_packing import check_budget
from fusedalign.data.prompts import prepare_prompt_dataset
from fusedalign.losses import (
    GRPOLossMetrics,
    count_items,
    entropy_threshold,
    entropy_weight,
    grpo_loss,
    high_entropy_mask,
)
from fusedalign.rewards import RewardFunctions
from fusedalign.trainers.base import FusedAlignTrainer
from fusedalign.trainers.generation_loaders import GenerationLoaders
from fusedalign.trainers.grpo_batch import GRPOMicroBatch
from fusedalign.trainers.grpo_rollout import GRPORollout
from fusedalign.trainers.rollout_setup import default_generator, reward_callables
from fusedalign.trainers.rollout_steps import RolloutSteps
from fusedalign.trainers.rollout_types import GroupAdvantages, Split
from fusedalign.trainers.policy import load_policy
from fusedalign.trainers.preference_inputs import check_models
from fusedalign.trainers.reference import Reference, load_reference_model


class GRPOTrainer(RolloutSteps, GenerationLoaders, FusedAlignTrainer):
    """Group Relative Policy Optimization with the fused output head.

    Args:
        model: A causal LM or a name/path (`builtin:tiny-qwen2`, a directory, a hub id).
        reward_funcs: A reward function (TRL's API, `f(prompts, completions, completion_ids,
            **columns) -> list[float | None]`), a name (`zen_words`, a dotted path, a reward
            model path) or a list of them; default: `args.reward_funcs` and
            `args.reward_model_name_or_path`.
        args: GRPOConfig.
        train_dataset, eval_dataset: Prompt-only data (a `prompt` column, standard or
            conversational); other columns are passed to the reward functions by name.
        processing_class: The tokenizer; default: loaded from the model's path.
        peft_config: A peft LoraConfig (with beta != 0 and no ref_model, the reference is the
            policy with its adapter disabled; LoRA on lm_head included).
        ref_model: A frozen reference or name/path, used when beta != 0 (default: the policy's path).
        generator: A `fusedalign.generation.Generator`; default from the args (transformers'
            generate, keyed sampling, or a replay of recorded completions).
    """

    def __init__(
        self,
        model: nn.Module | str,
        reward_funcs: Callable | str | Sequence[Callable | str] | None = None,
        args: GRPOConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
        ref_model: nn.Module | str | None = None,
        generator: Any = None,
    ):
        args = args or GRPOConfig()
        policy = load_policy(model, args, processing_class, peft_config)
        reference = load_reference_model(ref_model, policy, args, needed=args.beta != 0.0)
        check_models(args, policy.model, reference)
        tokenizer = policy.tokenizer
        reward_funcs = RewardFunctions(reward_callables(reward_funcs, args), args.reward_weights)
        (train_dataset, train_split), (eval_dataset, eval_split) = (
            self._prepare_split(d, tokenizer, args, reward_funcs) for d in (train_dataset, eval_dataset))
        if train_dataset is not None and args.padding_free:
            check_budget([len(p) for p in train_dataset["prompt_ids"]], args.max_completion_length,
                         args.max_tokens_per_batch)
        super().__init__(model=policy.model, args=args, data_collator=collate_rows, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=tokenizer, callbacks=callbacks)
        self.reference = Reference.prepare(reference, self.accelerator, policy_is_peft=policy.is_peft,
                                           needed=args.beta != 0.0, disable_dropout_=args.disable_dropout)
        for func in reward_funcs.funcs:
            if hasattr(func, "prepare"):
                func.prepare(self.accelerator)
        self.loss_options = args.loss_options()
        self.rollout = self.checkpointed("grpo_rollout", GRPORollout(
            args, generator if generator is not None else default_generator(args, tokenizer), reward_funcs,
            tokenizer, self.accelerator, self.metrics, lambda m, inputs, labels: self.token_logprobs(
                m, inputs, labels).logps, self.reference, train_split, eval_split, self.advantage_strategy(args)),
            per_rank=True)

    def advantage_strategy(self, args: GRPOConfig) -> GroupAdvantages:
        """The rollout's advantages (RLOO overrides it with its leave-one-out baseline)."""
        return GroupAdvantages(args.scale_rewards, args.multi_objective_aggregation)

    @property
    def generator(self) -> Any:
        return self.rollout.generator

    @property
    def reward_funcs(self) -> RewardFunctions:
        return self.rollout.reward_funcs

    @property
    def generation_step(self) -> int:
        """Training generations so far (the key of the next one's draws)."""
        return self.rollout.generations

    @property
    def ref_model(self) -> nn.Module | None:
        return self.reference.model

    # ------------------------------------------------------------------ the step (serving: RolloutSteps)

    def prepare_step(self, model: nn.Module, batches: list[dict[str, Any]], mode: str) -> list[GRPOMicroBatch]:
        """Generates at the start of every window, then serves its micro-batches in order."""
        prepared = self.serve(model, batches, mode)
        if self.args.entropy_coef != 0:
            # The bonus is coef x the entropy's mean over the step's loss tokens (every rank).
            totals = torch.stack([torch.stack([count_items(b.loss_mask, self.args.loss_type),
                                               b.loss_mask.sum().float()]) for b in prepared]).sum(0)
            totals = self.accelerator.reduce(totals, reduction="sum")
            weight = entropy_weight(self.args.entropy_coef, totals[0], totals[1])
            prepared = [b.replace(entropy_weight=weight) for b in prepared]
        return self.served(prepared)

    def count_items(self, inputs: GRPOMicroBatch) -> torch.Tensor:
        """The loss type's items: tokens (dapo, cispo, vespo), sequences, or the micro-batch (bnpo)."""
        return count_items(inputs.loss_mask, self.args.loss_type)

    def loss_and_metrics(self, model: nn.Module, inputs: GRPOMicroBatch, mode: str) -> tuple[torch.Tensor, GRPOLossMetrics]:
        args = self.args
        batch = inputs.require(old_logps=mode == "train" and args.needs_old_logps, ref_logps=args.beta != 0.0,
                               entropy_weight=args.entropy_coef != 0)
        mask = batch.loss_mask
        out = self.token_logprobs(model, *batch.forward_args(model), entropy=True, entropy_grad=args.entropy_coef != 0)
        out = out._replace(logps=batch.per_completion(out.logps), entropy=batch.per_completion(out.entropy))
        entropy_mask = None
        if args.top_entropy_quantile < 1.0:
            # TRL's threshold: a quantile of every rank's valid token entropies of this micro-batch.
            values = out.entropy.detach()[mask]
            padded = self.accelerator.pad_across_processes(values, pad_index=float("nan"))
            gathered = self.accelerator.gather(padded)
            threshold = entropy_threshold(gathered[~torch.isnan(gathered)], args.top_entropy_quantile)
            entropy_mask = high_entropy_mask(out.entropy.detach(), mask, threshold)
        result = grpo_loss(
            out.logps, mask, batch.advantages, self.loss_options, old_logps=batch.old_logps, ref_logps=batch.ref_logps,
            entropy=out.entropy, entropy_mask=entropy_mask,
            entropy_weight=0.0 if batch.entropy_weight is None else batch.entropy_weight,
            micro_batch_tokens=batch.micro_batch_tokens,
        )
        return result.loss_sum, result.metrics

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)
        self.rollout.completion_log.flush(self.args.output_dir, self.args.num_completions_to_print)

    @staticmethod
    def _prepare_split(dataset: Dataset | None, tokenizer: Any, args: GRPOConfig,
                       reward_funcs: RewardFunctions) -> tuple[Dataset | None, Split | None]:
        """The split's prompts tokenised, and its format; the reward functions' call checked against its columns."""
        if dataset is None:
            return None, None
        dataset, stats = prepare_prompt_dataset(dataset, tokenizer, max_prompt_length=args.max_prompt_length)
        reward_funcs.check_call([c for c in dataset.column_names if c not in ("prompt", "prompt_ids", "row_index")])
        return dataset, Split(stats.format.conversational)
