"""Model, reference and collator set-up shared by the preference trainers."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from transformers.utils import logging

from fusedalign.backbone import apply_liger_kernels, compile_decoder_layers
from fusedalign.models import load_model, load_tokenizer
from fusedalign.trainers.base import disable_dropout

logger = logging.get_logger(__name__)


class Models(NamedTuple):
    model: nn.Module
    ref_model: nn.Module | None
    tokenizer: Any
    is_peft: bool


def _dtype(args: Any) -> torch.dtype | None:
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def prepare_models(
    model: nn.Module | str,
    ref_model: nn.Module | str | None,
    args: Any,
    processing_class: Any,
    peft_config: Any,
    *,
    reference: bool,
) -> Models:
    """Loads the policy (and, when one is needed, the reference) and the tokenizer.

    Must run after `args` exists: under ZeRO-3 the arguments switch on zero.Init, so
    that `from_pretrained` loads each model already partitioned.
    """
    path = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    if isinstance(model, str):
        model = load_model(model, dtype=_dtype(args))
    tokenizer = processing_class if processing_class is not None else load_tokenizer(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(args, "liger_kernels", False):
        apply_liger_kernels(model)
    is_peft = peft_config is not None or hasattr(model, "peft_config")
    if peft_config is not None:
        from peft import get_peft_model
        from transformers import set_seed

        # The adapter's random init must not depend on what ran before in the process
        # (Trainer seeds only later, in its __init__), or runs are not reproducible.
        set_seed(args.seed)
        model = get_peft_model(model, peft_config)
    if getattr(args, "disable_dropout", False):
        disable_dropout(model)
    if isinstance(ref_model, str):
        ref_model = load_model(ref_model, dtype=_dtype(args))
    elif ref_model is None and reference and not is_peft:
        ref_path = getattr(args, "ref_model_name_or_path", None) or path
        if ref_path is None:
            raise ValueError("No reference model given and the policy has no path to load a copy from; pass ref_model.")
        # The reference in the policy's own dtype (e.g. `--dtype bfloat16` without `--bf16`).
        ref_model = load_model(ref_path, dtype=_dtype(args) or getattr(model, "dtype", None))
    if ref_model is not None and getattr(args, "liger_kernels", False):
        apply_liger_kernels(ref_model)
    if getattr(args, "compile_layers", False):
        from transformers.integrations import is_deepspeed_zero3_enabled

        for m in (model, ref_model):
            if m is not None:
                compile_decoder_layers(
                    m, zero3=is_deepspeed_zero3_enabled(), recompute=getattr(args, "compile_recompute", "elementwise"),
                    **getattr(args, "_layer_compile_options", {}),
                )
    return Models(model, ref_model, tokenizer, is_peft)


def tokenize_split(prepare: Any, dataset: Any, tokenizer: Any, split: str, **kwargs: Any) -> Any:
    """Validates and tokenises one split, reports truncation, and adds a row `index` column.

    The index lets precomputed reference log-probs be looked up per row.
    """
    if dataset is None:
        return None
    dataset, stats = prepare(dataset, tokenizer, **kwargs)
    if stats.num_truncated:
        logger.warning(
            "%s split: %d of %d rows were truncated to fit max_length/max_prompt_length (none were dropped).",
            split, stats.num_truncated, stats.num_rows,
        )
    return dataset.add_column("index", list(range(len(dataset))))
