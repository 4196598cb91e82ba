"""Refusals: models and attention implementations that cannot keep packed sequences apart.

Two ways of isolating sequences reach the attention kernel, and each has its own failure:

- restarting `position_ids` with no `attention_mask` (padding-free rows, packed SFT):
  transformers' mask builders (`masking_utils.create_causal_mask` and its sliding-window
  twin) split the row where the positions stop increasing by one, for eager, sdpa and flex
  attention, windows included; flash attention turns the positions into varlen boundaries
  where they return to 0. A model whose modeling code does not go through those builders,
  or an implementation without a builder, attends across the boundaries silently;
- an explicit mask (a shared prompt, where a rejected segment continues at position p - 1
  and would read as the same document as the chosen one): a 4D tensor or a `BlockMask`
  that the builders hand through unchanged. Only eager (an additive float mask), sdpa (a
  boolean mask) and flex attention (a `BlockMask`) take one; flash kernels take none.

Layers that are not softmax attention over the row (linear / recurrent layers carry a
state from one token to the next whatever the mask; chunked layers are untested here)
are refused for both.
"""

from __future__ import annotations

import functools
import inspect
import sys

from torch import nn

from fusedalign.head import unwrap_model

# Layer types whose mask is built (or handed through) by masking_utils for each layer.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# Implementations that take an explicit mask of arbitrary shape (shared prompts).
EXPLICIT_MASK_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")


class PackedAttentionError(ValueError):
    """The model's attention cannot keep packed sequences apart."""


def _decoder(lm: nn.Module) -> nn.Module:
    return lm.get_decoder() if hasattr(lm, "get_decoder") else lm


def _implementation(lm: nn.Module) -> str | None:
    return getattr(lm.config, "_attn_implementation", None)


def check_packed_attention(model: nn.Module) -> None:
    """Refuses a model whose attention would let packed sequences see each other.

    For rows whose sequences are told apart by restarting `position_ids` alone (no
    `attention_mask`); see the module docstring.

    Raises:
        PackedAttentionError: naming the model, the implementation or layer type, and the way out.
    """
    from transformers import masking_utils

    lm = unwrap_model(model)
    decoder = _decoder(lm)
    implementation = _implementation(lm)
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
    other = sorted(set(getattr(lm.config, "layer_types", None) or ()) - set(SUPPORTED_LAYER_TYPES))
    if other:
        raise PackedAttentionError(
            f"packing/padding_free: {type(lm).__name__} has layers of type {', '.join(map(repr, other))}, which do not "
            "confine each token to its own sequence by a mask (a recurrent state or chunked attention runs across "
            "the row). Train without --packing and --padding_free (padded batches)."
        )


def check_preference_attention(model: nn.Module, *, share_prompt: bool) -> None:
    """Refuses what cannot isolate the sequences of a padding-free (and shared-prompt) row.

    Raises:
        PackedAttentionError: one line naming the model or implementation and the way out.
    """
    check_packed_attention(model)
    lm = unwrap_model(model)
    implementation = _implementation(lm)
    if implementation == "sdpa" and getattr(lm.config, "attn_logit_softcapping", None) is not None:
        raise PackedAttentionError(
            f"padding_free: {type(lm).__name__} soft-caps its attention logits, which sdpa does not support; "
            "use --attn_implementation eager or flex_attention."
        )
    if share_prompt and implementation not in EXPLICIT_MASK_IMPLEMENTATIONS:
        why = ("flash attention splits a row where position_ids return to 0, so a rejected segment that continues "
               "at the prompt's last position would attend to the chosen tokens"
               if "flash" in str(implementation) else "it takes no explicit attention mask")
        raise PackedAttentionError(
            f"share_prompt: attention implementation {implementation!r} cannot isolate a shared prompt's "
            f"completions ({why}). Use --attn_implementation flex_attention (or sdpa / eager), or drop "
            "--share_prompt (padding-free rows work with it)."
        )


def layer_windows(model: nn.Module) -> dict[str, int | None]:
    """The attention window of each layer type the model masks for (None: no window).

    Models with `config.layer_types` mask per type; a model without it masks every layer
    alike, with a window when its decoder builds sliding-window masks and
    `config.sliding_window` is set (as Mistral's does).
    """
    from transformers import masking_utils

    lm = unwrap_model(model)
    config, decoder = lm.config, _decoder(lm)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return {t: (window if t == "sliding_attention" else None) for t in dict.fromkeys(types)}
    module = sys.modules.get(type(decoder).__module__)
    builds_windows = getattr(module, "create_sliding_window_causal_mask", None) is \
        masking_utils.create_sliding_window_causal_mask
    return {"sliding_attention": window} if builds_windows and window else {"full_attention": None}


def check_mask_mapping(model: nn.Module) -> None:
    """Refuses a model with several layer types whose forward takes no mask per layer type.

    transformers' modeling code accepts `attention_mask` as a dict {layer type: prepared
    mask} (`if not isinstance(causal_mask_mapping := attention_mask, dict)`, in 5.17 and
    5.24), which is how a shared prompt keeps a sliding window on some layers only.
    """
    lm = unwrap_model(model)
    if not _accepts_mask_mapping(type(_decoder(lm))):
        raise PackedAttentionError(
            f"share_prompt: {type(lm).__name__} mixes layer types {sorted(layer_windows(lm))} and its forward takes "
            "no attention mask per layer type, so a sliding window cannot be kept on a shared prompt's row longer "
            "than the window. Drop --share_prompt (padding-free rows keep every window), or lower max_length "
            f"below the window ({lm.config.sliding_window})."
        )


@functools.lru_cache(maxsize=None)
def _accepts_mask_mapping(decoder_class: type) -> bool:
    try:
        source = inspect.getsource(decoder_class.forward)
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in source
