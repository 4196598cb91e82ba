"""Attention that keeps several sequences of one row apart (padding-free and packed batches)."""

from __future__ import annotations

import sys

from torch import nn

from fusedalign.head import unwrap_model


class PackedAttentionError(ValueError):
    """The model's attention cannot keep packed sequences apart."""


def check_packed_attention(model: nn.Module) -> None:
    """Refuses a model whose attention would let packed sequences see each other.

    Padding-free batches rely on transformers building the attention mask from
    `position_ids` (`masking_utils.create_causal_mask` and its sliding-window twin split
    the row where the positions restart, for eager, sdpa and flex attention; flash
    attention turns the same positions into varlen boundaries). A model whose modeling
    code does not go through those builders (remote code, older architectures), or an
    attention implementation without a mask builder (a custom kernel), would silently
    attend across the boundaries.

    Raises:
        PackedAttentionError: naming the model, the implementation and the way out.
    """
    from transformers import masking_utils

    lm = unwrap_model(model)
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm
    implementation = getattr(lm.config, "_attn_implementation", None)
    module = sys.modules.get(type(decoder).__module__)
    builders = (masking_utils.create_causal_mask, masking_utils.create_sliding_window_causal_mask)
    uses_builders = module is not None and any(
        getattr(module, fn.__name__, None) is fn for fn in builders
    )
    if not uses_builders:
        raise PackedAttentionError(
            f"packing/padding_free: {type(lm).__name__} ({type(decoder).__module__}) does not build its attention "
            "mask with transformers.masking_utils, so nothing guarantees that packed sequences stay apart. "
            "Train without --packing and --padding_free (padded batches)."
        )
    if implementation not in masking_utils.ALL_MASK_ATTENTION_FUNCTIONS:
        supported = ", ".join(sorted(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS))
        raise PackedAttentionError(
            f"packing/padding_free: attention implementation {implementation!r} has no mask builder in "
            f"transformers, so packed sequences would attend to each other. Use one of {supported} "
            "(--attn_implementation), or train without --packing and --padding_free."
        )
