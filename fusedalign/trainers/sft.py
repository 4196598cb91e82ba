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

from fusedalign.configs import SFTConfig
from fusedalign.data import DataError, SFTCollator, pack_dataset, position_labels, prepare_sft_dataset
from fusedalign.attention import check_packed_attention
from fusedalign.head import IGNORE_INDEX
from fusedalign.losses import sft_loss, sft_metrics
from fusedalign.trainers.base import FusedAlignTrainer, Metrics
from fusedalign.trainers.common import prepare_models, tokenize_split

logger = logging.get_logger(__name__)

# Input tokens of a training micro-batch, recorded with the metrics (so that it rides
# their all-reduce) and turned into the cumulative `num_tokens` at each log.
_TOKENS_SEEN = "_tokens_seen"


class SFTTrainer(FusedAlignTrainer):
    """Supervised fine-tuning with the fused output head.

    The loss is the summed NLL of the label tokens divided by the number of label tokens
    in the global batch (every micro-batch of the optimizer step, every rank), so
    gradient accumulation and data-parallel splits give the update of one big batch.

    Args:
        model: A causal LM or a name/path (`builtin:tiny-qwen2`, a directory, a hub id).
        args: SFTConfig.
        train_dataset, eval_dataset: Language-modeling (`text` / `messages`) or
            prompt-completion data, standard or conversational, untokenised.
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
        models = prepare_models(model, None, args, processing_class, peft_config, reference=False)
        padding_free = args.padding_free or args.packing
        if padding_free:
            check_packed_attention(models.model)
        tokenizer = models.tokenizer
        train_dataset = self._prepare_split(train_dataset, tokenizer, args, "train")
        eval_dataset = self._prepare_split(eval_dataset, tokenizer, args, "eval")
        collator = SFTCollator(pad_token_id=tokenizer.pad_token_id, padding_free=padding_free)
        super().__init__(
            model=models.model, args=args, data_collator=collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=tokenizer, callbacks=callbacks,
        )
        self._total_tokens = 0.0

    # ------------------------------------------------------------------ data

    @staticmethod
    def _prepare_split(dataset: Dataset | None, tokenizer: Any, args: SFTConfig, split: str) -> Dataset | None:
        """Tokenises (reporting truncation), checks there is something to learn, packs."""
        dataset = tokenize_split(
            prepare_sft_dataset, dataset, tokenizer, split, completion_only_loss=args.completion_only_loss,
            assistant_only_loss=args.assistant_only_loss, max_length=args.max_length,
            truncation_mode=args.truncation_mode,
        )
        if dataset is None:
            return None
        # A sequence's first token is never predicted, so a row learns from mask[1:] only.
        empty = sum(1 for mask in dataset["completion_mask"] if not any(mask[1:]))
        if empty == len(dataset):
            raise DataError(
                f"{split} split: none of its {len(dataset)} rows has a token to learn from after tokenisation "
                "and truncation (the completion is empty or was cut off); check max_length, truncation_mode "
                "and completion_only_loss/assistant_only_loss."
            )
        if empty:
            logger.warning("%s split: %d of %d rows have no token to learn from (kept; they add nothing to the loss).",
                           split, empty, len(dataset))
        if args.packing:
            rows = len(dataset)
            dataset = pack_dataset(dataset, args.max_length)
            logger.info("%s split: packed %d sequences into %d rows of at most %d tokens.",
                        split, rows, len(dataset), args.max_length)
        return dataset

    # ------------------------------------------------------------------ counting

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

    # ------------------------------------------------------------------ loss

    def loss_and_metrics(self, model: nn.Module, inputs: dict[str, Any], mode: str) -> tuple[torch.Tensor, Metrics]:
        labels = self.labels(inputs)
        out = self.token_logprobs(model, self.model_inputs(inputs), labels, entropy=True, argmax=True)
        mask = labels != IGNORE_INDEX  # [B, T]
        # The NLL *sum*; the base divides by the global label-token count.
        loss_sum = sft_loss(out.logps, mask, num_tokens=1)
        stats = sft_metrics(mask, out.argmax_match, out.entropy)
        metrics: Metrics = {
            "mean_token_accuracy": (stats.correct_tokens, stats.num_tokens),
            "entropy": (stats.entropy, stats.num_tokens),
        }
        if mode == "eval":
            # Per row, so evaluation drops the rows accelerate repeats to even out ranks.
            tokens = mask.sum(-1).double()  # [B]
            metrics = {
                "mean_token_accuracy": ((out.argmax_match & mask).sum(-1).double(), tokens),
                "entropy": ((out.entropy * mask).sum(-1).double(), tokens),
            }
        if mode == "train":
            # As TRL: input tokens, padding excluded (a padding-free row has none).
            seen = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["input_ids"].numel()
            metrics[_TOKENS_SEEN] = (torch.as_tensor(seen), torch.zeros(()))
        return loss_sum, metrics

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        seen = self._metric_sums["train"].pop(_TOKENS_SEEN, None)
        if seen is not None:
            self._total_tokens += seen[0]
        if self.model.training and "loss" in logs:
            logs["num_tokens"] = self._total_tokens  # input tokens trained on so far, all ranks
        super().log(logs, start_time)
