"""Messages libraries print that are not the user's business, silenced one by one.

Each filter names the exact message and where it comes from, so anything else those
libraries say still reaches the user. Measured on 2026-12-03 (torch 2.13, DeepSpeed
0.19.8, transformers 5.24), six steps of ZeRO-3 DPO on CPU printed:
- DeepSpeed's "Setting accelerator to CPU" warning once per process, although running
  on the CPU is exactly what was asked for (a GPU config without a GPU is refused
  before DeepSpeed is imported, by fusedalign.launch);
- 27 FutureWarnings from torch about `all_gather_into_tensor` / `reduce_scatter_tensor`,
  functions DeepSpeed calls, not the user.
transformers' FutureWarning that `is_gradient_checkpointing` is deprecated, which PEFT's calls
raise on every adapter load and save (transformers 5.2x, 2026-12-05), and the one that
`gradient_checkpointing` and its kwargs, TRL's flag names, are deprecated aliases of
`activation_checkpointing` (transformers 5.25, every run given `--gradient_checkpointing`). And PEFT, saving an adapter whose base is a builtin model (recorded by its name,
`builtin:tiny-qwen2`), warns that it cannot find that name's config "and will assume the
vocabulary was not modified": true of every builtin model, whose vocabulary nothing resizes.
"""

from __future__ import annotations

import logging
import re
import warnings


class DropExact(logging.Filter):
    """Drops the records of one logger whose message starts with one of the given texts."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


DEEPSPEED_ACCELERATOR = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."

_installed = False


def quiet_known_noise() -> None:
    """Installs the filters (once per process, before DeepSpeed is imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    # DeepSpeed gets this logger by name when it is imported; a filter set now stays on it.
    logging.getLogger("DeepSpeed").addFilter(DropExact(DEEPSPEED_ACCELERATOR))
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated\. "
                r"Please use `torch\.distributed\.(all_gather_single|reduce_scatter_single)` instead\.",
        category=FutureWarning,
        module=re.escape("torch.distributed.c10d_logger"),
    )
    # transformers 5.2x, when PEFT asks a model whether it checkpoints (every adapter load and save).
    warnings.filterwarnings(
        "ignore",
        message=r"`is_gradient_checkpointing` is deprecated",
        category=FutureWarning,
    )
    # transformers 5.2x renames TrainingArguments' gradient_checkpointing(_kwargs) to
    # activation_checkpointing(_kwargs) and warns on the old names, which are TRL's flags: the
    # command line keeps them (both names work until transformers 6).
    warnings.filterwarnings(
        "ignore",
        message=r"`gradient_checkpointing(_kwargs)?` is deprecated and will be removed in v6\. "
                r"Use `activation_checkpointing(_kwargs)?` instead\.",
        category=FutureWarning,
        module=re.escape("transformers.training_args"),
    )
    warnings.filterwarnings(
        "ignore",
        message=r"Could not find a config file in builtin:",
        category=UserWarning,
        module=re.escape("peft.utils.save_and_load"),
    )
