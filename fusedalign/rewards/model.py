"""Sequence-classification reward models as reward functions (TRL's `reward_funcs=<model>`).

A model with one label (`AutoModelForSequenceClassification`, `num_labels=1`) scores prompt +
completion, tokenised with the reward model's own tokenizer: the text concatenated for
standard data, the chat template applied to the whole conversation for conversational data.
It is an `nn.Module` so that the trainer can prepare it under the running backend like the
frozen reference (`prepare(accelerator)`: a DeepSpeed inference engine under ZeRO-3, sharded
under FSDP2); every rank must then call it, each on its own completions.

A checkpoint without a trained one-label head (a causal LM, a classifier of other labels)
would load with a freshly initialised `score` layer and train against random rewards, so
`load_reward_model` reads transformers' loading info and refuses it in one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Sequence

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


def load_reward_model(name_or_path: str, *, dtype: Any = None, flag: str = "reward model",
                      **kwargs: Any) -> SequenceClassifierReward:
    """Loads `AutoModelForSequenceClassification(num_labels=1)` and its tokenizer as a reward.

    Args:
        name_or_path: a local directory, `builtin:<name>` or a hub id.
        dtype: as `fusedalign.models.load_model`.
        flag: how errors name where the path came from (`--reward_funcs`, ...).

    Raises:
        RewardError: the checkpoint has no trained one-label score head (see the module docstring).
    """
    from transformers import AutoModelForSequenceClassification

    from fusedalign.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(name_or_path)
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    if dtype is not None:
        kwargs["dtype"] = dtype
    with _held_load_report() as release:
        # ignore_mismatched_sizes: a head of other labels is then reported in the info, not raised.
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
        check_score_head(model, info, f"{flag} {name_or_path}")
        release()  # a report of unexpected keys alone still reaches the user
    return SequenceClassifierReward(model, load_tokenizer(path), name=os.path.basename(os.path.normpath(name_or_path)))


def check_score_head(model: nn.Module, info: dict, where: str) -> None:
    """Refuses weights `from_pretrained` initialised afresh instead of loading them (`info`: its loading info).

    Raises:
        RewardError: naming `where`, the checkpoint's architecture and the weights concerned.
    """
    from fusedalign.rewards.api import RewardError

    expected = "expected a sequence-classification reward model (num_labels=1)"
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
        raise RewardError(f"{where} is a {arch} checkpoint with no trained score head ({', '.join(missing)} missing: "
                          f"it would be initialised at random, and so would the rewards); {expected}")
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda k: k[0])
    if mismatched:
        key, saved, wanted = mismatched[0]
        raise RewardError(f"{where}: {key} has shape {list(saved)} in the checkpoint, not the {list(wanted)} of a "
                          f"one-label score head (a classifier of other labels); {expected}")


@contextlib.contextmanager
def _held_load_report() -> Iterator[Any]:
    """Holds back transformers' load report (a table of missing and unexpected keys) until the
    caller calls the yielded function: a refused checkpoint then shows one line, not the table too."""
    log = logging.getLogger("transformers.modeling_utils")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            held.append(record)
            return False
        return True

    def release() -> None:
        log.removeFilter(hold)
        for record in held:
            log.handle(record)
        held.clear()

    log.addFilter(hold)
    try:
        yield release
    finally:
        log.removeFilter(hold)
