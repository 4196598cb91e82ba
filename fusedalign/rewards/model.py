"""Sequence-classification reward models as reward functions (TRL's `reward_funcs=<model>`).

A model with one label (`AutoModelForSequenceClassification`, `num_labels=1`) scores prompt +
completion, tokenised with the reward model's own tokenizer: the text concatenated for
standard data, the chat template applied to the whole conversation for conversational data.
It is an `nn.Module` so that the trainer can prepare it under the running backend like the
frozen reference (`prepare(accelerator)`: a DeepSpeed inference engine under ZeRO-3, sharded
under FSDP2); every rank must then call it, each on its own completions.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
from torch import nn


class SequenceClassifierReward(nn.Module):
    """A reward function around a one-label sequence classifier and its tokenizer.

    Args:
        model: the classifier (`logits` [N, 1]).
        tokenizer: its tokenizer (a pad token is set to EOS if it has none).
        name: the logged name; default the model's directory or hub name.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, name: str | None = None):
        super().__init__()
        num_labels = getattr(getattr(model, "config", None), "num_labels", 1)
        if num_labels != 1:
            raise ValueError(f"a reward model must have one label (num_labels=1), got {num_labels}")
        self.model = model
        self.tokenizer = tokenizer
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if getattr(model.config, "pad_token_id", None) is None:
            # The classifier reads the logits of each row's last non-pad token.
            model.config.pad_token_id = tokenizer.pad_token_id
        path = getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.reward_name = name or os.path.basename(os.path.normpath(path))
        self._device: torch.device | None = None

    def prepare(self, accelerator: Any) -> None:
        """Makes the model callable under the running backend (as the frozen reference is)."""
        from fusedalign.distributed import prepare_reference_model

        self.model = prepare_reference_model(self.model, accelerator)
        self._device = accelerator.device

    def texts(self, prompts: Sequence, completions: Sequence) -> list[str]:
        """What the classifier reads for each completion."""
        if prompts and isinstance(prompts[0], list):
            return [self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False)
                    for p, c in zip(prompts, completions)]
        return [p + c for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def forward(self, prompts: Sequence, completions: Sequence, completion_ids: Sequence | None = None,
                **kwargs: Any) -> list[float]:
        enc = self.tokenizer(self.texts(prompts, completions), return_tensors="pt", padding=True,
                             padding_side="right", add_special_tokens=False)
        device = self._device or next(self.model.parameters()).device
        logits = self.model(**{k: v.to(device) for k, v in enc.items()}).logits  # [N, 1]
        return logits[:, 0].float().tolist()


def load_reward_model(name_or_path: str, *, dtype: Any = None, **kwargs: Any) -> SequenceClassifierReward:
    """Loads `AutoModelForSequenceClassification(num_labels=1)` and its tokenizer as a reward.

    Args:
        name_or_path: a local directory, `builtin:<name>` or a hub id.
        dtype: as `fusedalign.models.load_model`.
    """
    from transformers import AutoModelForSequenceClassification

    from fusedalign.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(name_or_path)
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
    return SequenceClassifierReward(model, load_tokenizer(path), name=os.path.basename(os.path.normpath(name_or_path)))
