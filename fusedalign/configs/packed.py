"""The checks of padding-free preference batches, shared by DPOConfig, KTOConfig and GRPOConfig
(and RLOOConfig, which extends it).

`padding_free`, `share_prompt` and `max_tokens_per_batch` are checked here once, when
the config is made; what needs the model or the data (an attention implementation that
cannot keep a row's sequences apart, a pair longer than the budget) is refused when the
trainer is made, before any step.
"""

from __future__ import annotations

from typing import Any

PADDING_FREE_HELP = (
    "Concatenate each micro-batch's sequences into one row, no padding, each sequence confined to itself "
    "(position_ids; a mask with share_prompt). Same losses and gradients as padded batches."
)
PAD_MULTIPLE_HELP = (
    "Round each micro-batch's length up to a multiple of this (TRL's flag; its 'auto' pads only on Neuron, so "
    "None here is the same elsewhere). Padded rows get right padding; a padding-free row one padding segment "
    "that sees only itself. With --compile_layers and --max_tokens_per_batch, a multiple of the budget's order "
    "keeps the compiled shapes few."
)
MAX_TOKENS_HELP = (
    "With padding_free: micro-batches of whole {units} up to this many tokens (instead of "
    "per_device_train_batch_size rows), so memory stays flat whatever the lengths; the loss stays the mean "
    "over the optimizer step's {units}. A {unit} longer than the budget is refused when the trainer is made."
)

# GRPO's and RLOO's budget: the completions of a step regrouped by prompt (GRPO adds what its loss types keep).
GROUPS_BUDGET_HELP = (
    "With padding_free: the completions of each optimizer step (the same ones as padded batches) are regrouped "
    "by prompt and packed into rows of at most this many tokens (a group split when it alone is over), one row "
    "a micro-batch where the step's gradient_accumulation_steps forwards hold them, else each micro-batch "
    "trained as several rows, one forward and backward each, so memory stays that of one row. Same update as "
    "padded batches{note}. Must hold the longest prompt and a completion of max_completion_length."
)


def check_packed_batching(args: Any, unit: str) -> None:
    """Refuses combinations of the packed-batch flags that cannot run (one line each).

    Args:
        args: a DPOConfig, KTOConfig or GRPOConfig after `TrainingArguments.__post_init__`.
        unit: what a micro-batch holds whole ("pair", "example", "completion"), for the messages.

    Raises:
        ValueError: naming the flags and the way out.
    """
    if args.share_prompt and not args.padding_free:
        raise ValueError(
            "share_prompt computes each prompt once inside a padding-free row: add --padding_free true "
            "(or drop --share_prompt)."
        )
    multiple = getattr(args, "pad_to_multiple_of", None)
    if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
        raise ValueError(f"pad_to_multiple_of must be a positive number of tokens or None, got {multiple!r}.")
    budget = args.max_tokens_per_batch
    if budget is None:
        return
    if not args.padding_free:
        raise ValueError(
            f"max_tokens_per_batch={budget} packs whole {unit}s into padding-free micro-batches: add "
            "--padding_free true (padded batches take per_device_train_batch_size)."
        )
    if budget < 1:
        raise ValueError(f"max_tokens_per_batch must be a positive number of tokens, got {budget}.")
    if args.train_sampling_strategy == "group_by_length":
        raise ValueError(
            "train_sampling_strategy='group_by_length' groups padded batches by length; with max_tokens_per_batch "
            "the token-budget sampler forms the micro-batches itself. Use 'random' (shuffled plan) or "
            "'sequential' (dataset order)."
        )
    if getattr(args.accelerator_config, "split_batches", False):
        raise ValueError(
            "max_tokens_per_batch makes micro-batches of varying size, which accelerate cannot split across "
            "ranks: set accelerator_config split_batches=False (the default)."
        )
