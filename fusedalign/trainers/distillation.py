"""DistillationTrainer: the student samples on-policy, the teacher scores, both heads fused in the loss.

Step preparation is GRPO's generation (`trainers/distillation_rollout.py`, a GRPORollout
without rewards): once per optimizer step the student samples one completion for each of
the step's prompts (per-device batch x ranks x gradient_accumulation_steps, TRL 1.16's
generation batch), with keyed sampling and replay available and the window checkpointed per
rank. The loss is `distill_head.token_divergence`: the teacher's ordinary forward keeps its
final hidden states, the student's ordinary forward computes the generalised JSD inside the
student's head *and* the teacher's head module (so each head's weight is read inside its own
module's call, and a ZeRO-3 or FSDP2 teacher is gathered by its own hooks), no N x V logits of
either model alive. Each micro-batch returns its summed divergence over its completion tokens;
the base divides by the completion tokens of the whole optimizer step over every rank (TRL's
`num_items_in_batch`, gathered over the generation batch), `losses/distillation.py`.
With `padding_free` a micro-batch is one packed row (`trainers/distillation_batch.py`): no
padding and each prompt once through each backbone, the same loss and metrics.

The data loaders, evaluation and completion log are GRPOTrainer's, which this class extends;
its constructor is its own (no reward functions, no reference, a teacher).
"""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset
from torch import nn

from fusedalign.configs import DistillationConfig
from fusedalign.data.grpo import collate_rows
from fusedalign.data.grpo_packing import check_budget
from fusedalign.data.prompts import prepare_prompt_dataset
from fusedalign.distill_head import token_divergence
from fusedalign.distributed import prepare_reference_model
from fusedalign.losses.distillation import DistillationMetrics, distillation_batch_loss
from fusedalign.trainers.base import FusedAlignTrainer
from fusedalign.trainers.distillation_batch import DistillationBatch, PackedDistillationBatch, distillation_batch
from fusedalign.trainers.distillation_rollout import DistillationRollout
from fusedalign.trainers.grpo import GRPOTrainer
from fusedalign.trainers.rollout_setup import default_generator
from fusedalign.trainers.rollout_types import Split
from fusedalign.trainers.policy import disable_dropout, load_policy
from fusedalign.trainers.preference_inputs import check_models
from fusedalign.trainers.teacher import load_teacher


class DistillationTrainer(GRPOTrainer):
    """On-policy distillation with both output heads fused.

    Args:
        model: the student: a causal LM or a name/path (`builtin:tiny-qwen2`, a directory, a hub id).
        teacher_model: the teacher, a causal LM or a name/path sharing the student's tokenizer;
            default: `args.teacher_model_name_or_path`.
        args: DistillationConfig.
        train_dataset, eval_dataset: prompt-only data (a `prompt` column, standard or
            conversational); a completion column, if any, is not used.
        processing_class: the tokenizer; default: loaded from the student's path.
        peft_config: a peft LoraConfig for the student (LoRA on lm_head included).
        generator: a `fusedalign.generation.Generator`; default from the args (transformers'
            generate, keyed sampling, or a replay of recorded completions).
    """

    generation_batch_flags = "per_device_train_batch_size or gradient_accumulation_steps"  # one prompt a completion

    def __init__(
        self,
        model: nn.Module | str,
        teacher_model: nn.Module | str | None = None,
        args: DistillationConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
        generator: Any = None,
    ):
        args = args or DistillationConfig()
        if not isinstance(args, DistillationConfig):
            raise TypeError(f"DistillationTrainer takes a DistillationConfig; got {type(args).__name__}")
        policy = load_policy(model, args, processing_class, peft_config)
        teacher = load_teacher(teacher_model, policy, args)
        check_models(args, policy.model, teacher)  # padding_free: both models can keep a row's sequences apart
        tokenizer = policy.tokenizer
        (train_dataset, train_split), (eval_dataset, eval_split) = (
            _prepare_split(d, tokenizer, args) for d in (train_dataset, eval_dataset))
        if train_dataset is not None and args.padding_free:
            check_budget([len(p) for p in train_dataset["prompt_ids"]], args.max_completion_length,
                         args.max_tokens_per_batch)
        FusedAlignTrainer.__init__(self, model=policy.model, args=args, data_collator=collate_rows,
                                   train_dataset=train_dataset, eval_dataset=eval_dataset,
                                   processing_class=tokenizer, callbacks=callbacks)
        disable_dropout(teacher)  # the teacher's distribution is a target: never a dropout sample of it
        self.teacher_model = prepare_reference_model(teacher, self.accelerator)
        self.rollout = self.checkpointed("distillation_rollout", DistillationRollout(
            args, generator if generator is not None else default_generator(args, tokenizer), tokenizer,
            self.accelerator, self.metrics, train_split, eval_split), per_rank=True)

    @property
    def ref_model(self) -> None:
        return None

    # ------------------------------------------------------------------ the step

    def prepare_step(self, model: nn.Module, batches: list[dict[str, Any]],
                     mode: str) -> list[DistillationBatch | PackedDistillationBatch]:
        """Generates at the start of every optimizer step, then serves its micro-batches in order."""
        serve = self.rollout.train_batch if mode == "train" else self.rollout.eval_batch
        return [distillation_batch(serve(model, item["rows"], self.state)) for item in batches]

    def count_items(self, inputs: DistillationBatch | PackedDistillationBatch) -> torch.Tensor:
        """Completion tokens: the divergence is a mean over the step's completion tokens (TRL)."""
        return inputs.loss_mask.sum().float()

    def loss_and_metrics(self, model: nn.Module, inputs: DistillationBatch | PackedDistillationBatch,
                         mode: str) -> tuple[torch.Tensor, DistillationMetrics]:
        """One forward of each model over the micro-batch's rows (padded, or one packed row whose
        prompts run once through each backbone), the divergence read back per completion."""
        args = self.args
        student_inputs, labels = inputs.forward_args(model)
        teacher_inputs, _ = inputs.forward_args(self.teacher_model)
        out = token_divergence(model, self.teacher_model, student_inputs, labels, fused=args.fused_head,
                               beta=args.beta, temperature=args.temperature, teacher_inputs=teacher_inputs)
        return distillation_batch_loss(inputs.per_completion(out.divergence), inputs.loss_mask,
                                       inputs.per_completion(out.entropy))


def _prepare_split(dataset: Dataset | None, tokenizer: Any,
                   args: DistillationConfig) -> tuple[Dataset | None, Split | None]:
    """The split's prompts tokenised, and its format."""
    if dataset is None:
        return None, None
    dataset, stats = prepare_prompt_dataset(dataset, tokenizer, max_prompt_length=args.max_prompt_length)
    return dataset, Split(stats.format.conversational)
