"""SFTTrainer: batch -> labels -> log-probs (fused or not) -> NLL -> metrics.

Padded batches carry an `attention_mask`. Padding-free batches (`padding_free`, and
always with `packing`) are one row `[1, L]` with `position_ids` restarting at 0 at each
sequence and no `attention_mask`: the model's mask builder then makes the attention
block-diagonal, and `position_labels` never scores across a boundary, so a packed batch
computes exactly what its sequences would alone, without a pad token in sight.
"""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers.utils import logging

from fusedalign.attention import check_packed_attention
from fusedalign.configs import SFTConfig
from fusedalign.data import SFTCollator, pack_dataset, position_labels
from fusedalign.data.splits import prepare_split
from fusedalign.data.text_field import with_text_field
from fusedalign.head import IGNORE_INDEX
from fusedalign.losses import SFTMetrics, sft_batch_loss
from fusedalign.trainers.base import FusedAlignTrainer
from fusedalign.trainers.policy import load_policy

logger = logging.get_logger(__name__)


class SFTTrainer(FusedAlignTrainer):
    """Supervised fine-tuning with the fused output head.

    The loss is the summed NLL of the label tokens divided by the number of label tokens
    in the global batch (every micro-batch of the optimizer step, every rank), so
    gradient accumulation and data-parallel splits give the update of one big batch.

    Args:
        model: A causal LM or a name/path (`builtin:tiny-qwen2`, a directory, a hub id).
        args: SFTConfig.
        train_dataset, eval_dataset: Language-modeling (`text` / `messages`) or
            prompt-completion data, standard or conversational, untokenised; or tokenised
            rows (`input_ids`, optionally `completion_mask`), used as they are.
        processing_class: The tokenizer; default: loaded from the model's path.
        peft_config: A peft LoraConfig to train an adapter instead of the full model.
    """

    def __init__(
        self,
        model: nn.Module | str,
        args: SFTConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
    ):
        args = args or SFTConfig()
        policy = load_policy(model, args, processing_class, peft_config)
        padding_free = args.padding_free or args.packing
        if padding_free:
            check_packed_attention(policy.model)
        super().__init__(
            model=policy.model, args=args,
            data_collator=SFTCollator(pad_token_id=policy.tokenizer.pad_token_id, padding_free=padding_free),
            train_dataset=self._prepare_split(train_dataset, policy.tokenizer, args, "train"),
            eval_dataset=self._prepare_split(eval_dataset, policy.tokenizer, args, "eval"),
            processing_class=policy.tokenizer, callbacks=callbacks,
        )

    @staticmethod
    def _prepare_split(dataset: Dataset | None, tokenizer: Any, args: SFTConfig, split: str) -> Dataset | None:
        """Tokenises (reporting truncation and refusing a split with nothing to learn), packs."""
        dataset = prepare_split(
            "sft", with_text_field(dataset, args.dataset_text_field), tokenizer, split,
            completion_only_loss=args.completion_only_loss,
            assistant_only_loss=args.assistant_only_loss, max_length=args.max_length,
            truncation_mode=args.truncation_mode,
        )
        if dataset is None:
            return None
        if args.packing:
            rows = len(dataset)
            dataset = pack_dataset(dataset, args.max_length)
            logger.info("%s split: packed %d sequences into %d rows of at most %d tokens.",
                        split, rows, len(dataset), args.max_length)
        return dataset

    # ------------------------------------------------------------------ the step

    @staticmethod
    def labels(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Position-aligned labels `[B, T]`; never across a packed boundary."""
        return position_labels(inputs["input_ids"], inputs["completion_mask"], position_ids=inputs.get("position_ids"))

    @staticmethod
    def model_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward arguments: padding-free batches pass position_ids and, on purpose, no attention_mask."""
        if "position_ids" in inputs:
            return {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"]}
        return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}

    def count_items(self, inputs: dict[str, Any]) -> torch.Tensor:
        """Label tokens of the micro-batch."""
        return (self.labels(inputs) != IGNORE_INDEX).sum()

    def loss_and_metrics(self, model: nn.Module, inputs: dict[str, Any], mode: str) -> tuple[torch.Tensor, SFTMetrics]:
        labels = self.labels(inputs)
        out = self.token_logprobs(model, self.model_inputs(inputs), labels, entropy=True, argmax=True)
        # Evaluation of padding-free rows: metrics per input row (accelerate drops repeated
        # rows by their count), which costs reading the row count back; training sums anyway.
        examples = inputs.get("example_ids") if mode == "eval" else None
        return sft_batch_loss(out.logps, labels != IGNORE_INDEX, out.argmax_match, out.entropy, examples)
