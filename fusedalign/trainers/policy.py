"""The policy a trainer trains: loaded, adapted (PEFT), sped up, with its tokenizer.

Must run after the arguments exist: under ZeRO-3 they switch on zero.Init, so that
`from_pretrained` loads each model already partitioned.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from fusedalign.backbone import apply_liger_kernels, compile_decoder_layers
from fusedalign.distributed import check_compile_layers_supported
from fusedalign.models import load_model_with, load_tokenizer
from fusedalign.tiled_mlp import tile_mlps


class Policy(NamedTuple):
    """What `load_policy` returns.

    Attributes:
        model: the policy, PEFT-wrapped when an adapter is trained.
        tokenizer: its tokenizer, with a pad token.
        is_peft: whether the policy carries a PEFT adapter (then, with no reference
            model given, the reference is the policy with its adapter disabled).
        path: where the policy was loaded from (the default reference's path), or None.
    """

    model: nn.Module
    tokenizer: Any
    is_peft: bool
    path: str | None


def model_dtype(args: Any) -> torch.dtype | None:
    """The dtype a frozen model (reference, teacher) loads in when none is asked for: bf16/fp16 under those
    flags, else None."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def load_policy(model: nn.Module | str, args: Any, processing_class: Any = None, peft_config: Any = None) -> Policy:
    """Loads (or takes) the policy, its tokenizer and adapter, and applies the backbone options."""
    path = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    if isinstance(model, str):
        # As TRL: `model_init_kwargs` for from_pretrained, float32 weights unless they name a dtype.
        model = load_model_with(model, "model_init_kwargs", getattr(args, "model_init_kwargs", None), dtype="float32")
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
    layer_options(model, args)
    return Policy(model, tokenizer, is_peft, path)


def layer_options(model: nn.Module | None, args: Any) -> None:
    """The decoder layers' options: `--tiled_mlp_tokens` (each MLP over tiles of tokens), then
    `--compile_layers` (each layer's forward compiled, where the backend allows it)."""
    if model is None:
        return
    if getattr(args, "tiled_mlp_tokens", 0):
        tile_mlps(model, args.tiled_mlp_tokens)
    if getattr(args, "compile_layers", False):
        check_compile_layers_supported()
        compile_decoder_layers(
            model, recompute=getattr(args, "compile_recompute", "elementwise"),
            **getattr(args, "_layer_compile_options", {}),
        )


def disable_dropout(model: nn.Module) -> None:
    """Sets every dropout probability of `model` to 0 (TRL's `disable_dropout`)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
