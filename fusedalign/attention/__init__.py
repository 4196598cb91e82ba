"""Attention that keeps several sequences of one row apart (padding-free, packed, shared-prompt rows).

`attention_inputs(model, batch)` turns a packed row (`fusedalign.data.preference_batches`)
into the forward's keyword arguments, through the paths transformers and PyTorch provide
and nothing else (no modeling code copied, no model class patched):

| row | eager | sdpa | flex_attention | flash_attention_* |
|---|---|---|---|---|
| padding-free (each sequence from position 0) | position_ids | position_ids | `BlockMask` | position_ids (varlen) |
| shared prompt | 4D additive mask | 4D boolean mask | `BlockMask` | refused |

"position_ids" means: no `attention_mask`, so transformers' own builders split the row
where the positions restart (windows included). On flex attention every packed row gets our
own `BlockMask` (`masks.block_mask`, built eagerly): transformers' builder for position_ids
compiles `create_block_mask` for each new row length, which for long rows takes minutes (the
same compilation kept an 8,320-token shared-prompt row out of its first step for over 400 s on
an H100, bf33ce2). An explicit mask is handed through those
builders unchanged (transformers 5.17 and 5.24: `_preprocess_mask_arguments` returns a 4D
tensor or a `BlockMask` as it is, for every layer type); a model mixing full and
sliding-window layers then gets a dict {layer type: mask}, which its forward accepts in
place of a mask, once a row is long enough for the window to matter.

On flex attention the forward that reads these arguments also gets `kernel_options` that keep
PyTorch off flex's decoding kernel: `fusedalign.head.forward_inputs` adds them to every forward
a trainer runs (packed or not), and says why.

What runs where: eager and sdpa everywhere; flex attention's forward on CPU (compiled by
transformers) but not its backward (PyTorch raises), both on CUDA; flash kernels on CUDA.
The dense masks hold R x L x L booleans (a 16k-token row: 256 MiB) and attend over the
whole row (sdpa cannot skip the masked blocks): long shared-prompt rows belong on flex
attention, which skips empty blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fusedalign.attention.checks import (
    EXPLICIT_MASK_IMPLEMENTATIONS,
    SUPPORTED_LAYER_TYPES,
    PackedAttentionError,
    check_mask_mapping,
    check_packed_attention,
    check_preference_attention,
    layer_windows,
)
from fusedalign.attention.masks import additive_mask, block_mask, visibility
from fusedalign.head import unwrap_model

__all__ = [
    "EXPLICIT_MASK_IMPLEMENTATIONS", "SUPPORTED_LAYER_TYPES", "PackedAttentionError", "additive_mask",
    "attention_inputs", "block_mask", "mask_signature", "check_mask_mapping", "check_packed_attention",
    "check_preference_attention", "layer_windows", "visibility",
]


def attention_inputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Forward keyword arguments that confine each sequence of a packed row to itself.

    Build them once per batch and reuse them for the policy's and the reference's forward
    (the masks depend on the row alone).

    Args:
        model: The model as the backend prepared it (DDP, DeepSpeed, PEFT, FSDP2 wrappers are seen through).
        batch: A packed row: `input_ids, position_ids, segment_ids, parent_ids` [R, L] on the
            model's device (other keys are ignored).

    Returns:
        `input_ids`, `position_ids` and, for a shared prompt or on flex attention, `attention_mask`
        (a tensor, a `BlockMask`, or a dict of them per layer type). Call the model with `use_cache=False`.

    Raises:
        PackedAttentionError: the model or its attention implementation cannot isolate the
            row's sequences (see `check_preference_attention`).
    """
    kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    shared = bool((batch["parent_ids"] >= 0).any())  # one host sync per batch
    check_preference_attention(model, share_prompt=shared)
    lm = unwrap_model(model)
    implementation = lm.config._attn_implementation
    if not shared and implementation != "flex_attention":
        return kwargs
    windows = layer_windows(lm)
    furthest = int(batch["position_ids"].max())
    # A window no query-key pair of this row reaches changes nothing: leave it out, so
    # that one mask serves every layer.
    needed = {kind: (w if w is not None and w <= furthest else None) for kind, w in windows.items()}
    dtype = lm.get_input_embeddings().weight.dtype
    masks = {w: _mask(implementation, batch, w, dtype) for w in set(needed.values())}
    if len(masks) == 1:
        kwargs["attention_mask"] = next(iter(masks.values()))
    else:
        check_mask_mapping(lm)
        kwargs["attention_mask"] = {kind: masks[w] for kind, w in needed.items()}
    return kwargs


def mask_signature(model: nn.Module) -> tuple:
    """What a packed row's forward arguments depend on besides the row: arguments built for one
    model serve another with the same signature (a policy and its reference, usually)."""
    lm = unwrap_model(model)
    return (type(lm), lm.config._attn_implementation, tuple(layer_windows(lm).items()),
            lm.get_input_embeddings().weight.dtype)


def _mask(implementation: str, batch: dict[str, torch.Tensor], window: int | None, dtype: torch.dtype):
    rows = (batch["segment_ids"], batch["parent_ids"], batch["position_ids"])
    if implementation == "flex_attention":
        return block_mask(*rows, window)
    visible = visibility(*rows, window)  # [R, 1, L, L]
    return additive_mask(visible, dtype) if implementation == "eager" else visible
