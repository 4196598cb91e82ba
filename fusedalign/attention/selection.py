"""Which attention a padding-free preference row runs on, on CUDA.

A padding-free row holds many sequences. On sdpa (and eager) transformers builds a dense
L x L mask for it (from the restarting `position_ids`, or ours for a shared prompt), and
the kernel attends over the whole row: its cost grows with the row's square, not with the
sequences' own, and a masked sdpa call leaves the flash kernels. On one H200 (2026-12-04,
f9b5da6) padding-free DPO with 8 pairs of held-out long completions a micro-batch ran at
0.50x TRL + Liger's pairs/s on sdpa. Flex attention's `BlockMask` skips the blocks that
belong to other sequences, so its cost follows the segments.

So, on CUDA, for padding-free DPO and KTO:
- a model loaded by fusedalign with no attention implementation asked for (`load_model`
  without `attn_implementation`, the trainers given a name or path, the CLI without
  `--attn_implementation`) is switched to flex attention when PyTorch has it, saying so
  in one line;
- an implementation asked for (or a model built outside fusedalign, whose choice cannot be
  told from the default) is kept, as it computes the same losses; sdpa or eager with rows
  that may exceed `DENSE_ROW_LIMIT` tokens get one line saying what it costs and the way out.
On the CPU nothing changes (flex attention's backward does not run there).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from fusedalign.head import unwrap_model

# Set by fusedalign.models.load_model on the models it loads: whether the caller asked for an
# attention implementation (absent: a model built elsewhere, taken as asked for).
ATTENTION_ASKED = "_fusedalign_attn_implementation_asked"
# Longest padding-free row (tokens) that sdpa or eager may take on CUDA: a dense 2k x 2k mask
# is 4 MiB of booleans a row and a small share of a step.
DENSE_ROW_LIMIT = 2048
DENSE = ("sdpa", "eager")


def row_tokens(args: Any) -> int | None:
    """The most tokens a padding-free micro-batch row can hold, or None when unbounded.

    With `max_tokens_per_batch`: that budget (rounded up to `pad_to_multiple_of`); else
    `per_device_train_batch_size` pairs (KTO: examples with their KL partner), two
    sequences of at most `max_length` each.
    """
    budget = getattr(args, "max_tokens_per_batch", None)
    if budget is None:
        if args.max_length is None:
            return None
        budget = 2 * args.per_device_train_batch_size * args.max_length
    multiple = getattr(args, "pad_to_multiple_of", None)
    return -(-budget // multiple) * multiple if multiple else budget


def packed_attention(implementation: str | None, *, on_cuda: bool, flex_available: bool, asked: bool) -> str | None:
    """The implementation a padding-free row runs on (see the module docstring)."""
    if on_cuda and implementation in DENSE and not asked and flex_available:
        return "flex_attention"
    return implementation


def dense_row_cost(implementation: str | None, *, on_cuda: bool, flex_available: bool, tokens: int | None) -> str | None:
    """One line on what a dense implementation costs padding-free rows on CUDA, or None when little."""
    if not on_cuda or implementation not in DENSE or (tokens is not None and tokens <= DENSE_ROW_LIMIT):
        return None
    size = f"up to {tokens:,}" if tokens is not None else "an unbounded number of"
    flex = "flex_attention" + ("" if flex_available else " (PyTorch >= 2.5)")
    return (f"padding_free on CUDA with attention implementation {implementation!r}: each packed row ({size} tokens) "
            "attends over a dense mask whose cost grows with the row's square, not its sequences' (0.50x TRL + "
            f"Liger's pairs/s measured on an H200); --attn_implementation {flex} (the default when none is given) "
            "or flash_attention_2 (without --share_prompt) follow the sequences, as do rows of at most "
            f"{DENSE_ROW_LIMIT} tokens (--max_tokens_per_batch).")


def _flex_available() -> bool:
    from transformers.utils import is_torch_flex_attn_available

    return is_torch_flex_attn_available()


def choose_packed_attention(args: Any, *models: nn.Module | None) -> None:
    """At a padding-free trainer's init: the policy (the first model) decides with `packed_attention`;
    a reference on a dense implementation follows it to flex attention, so both mask alike."""
    import torch

    models = tuple(unwrap_model(m) for m in models if m is not None)
    if not models:
        return
    on_cuda = torch.cuda.is_available() and not getattr(args, "use_cpu", False)
    flex_available = on_cuda and _flex_available()
    main = getattr(args, "process_index", 0) == 0
    policy = models[0]
    current = policy.config._attn_implementation
    chosen = packed_attention(current, on_cuda=on_cuda, flex_available=flex_available,
                              asked=getattr(policy, ATTENTION_ASKED, True))
    if chosen != "flex_attention":
        cost = dense_row_cost(current, on_cuda=on_cuda, flex_available=flex_available, tokens=row_tokens(args))
        if cost and main:
            print(f"[fusedalign] {cost}", file=sys.stderr)
        return
    switched = [lm for lm in models if lm.config._attn_implementation in DENSE]
    for lm in switched:
        lm.set_attn_implementation(chosen)
    if switched and main:
        print(f"[fusedalign] padding_free on CUDA: attention runs on flex_attention, not {current}, whose dense "
              f"mask of a packed row costs the row's square (--attn_implementation {current} keeps it).",
              file=sys.stderr)
