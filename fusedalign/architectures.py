"""How each architecture processes its logits after `lm_head`, for the fused head.

A model may transform the head's output before returning logits (Gemma 2/3 soft-cap
them, Cohere multiplies by a scale, Granite divides). While the fused head is active
that step must move into the op (it acts on the logits inside the softmax), and the
model's own copy must be switched off, or the log-probs would be of the wrong
distribution. Only architectures whose `ForCausalLM.forward` was read are registered;
any other is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn


class UnsupportedArchitectureError(ValueError):
    """Raised for a model whose post-head logit processing fusedalign cannot vouch for."""


# Each entry reads the step's parameters from the causal-LM module and returns them with
# a function that switches the model's own step off (and returns its undo).


@dataclass(frozen=True)
class PostProcessing:
    """How the model transforms `lm_head`'s output; folded into the op while fused."""

    softcap: float | None = None
    logit_scale: float = 1.0
    disable: Callable[[], Callable[[], None]] = field(default=lambda: (lambda: None))


def _no_post_processing(lm: nn.Module) -> PostProcessing:
    return PostProcessing()


def _swap_attr(obj: Any, name: str, value: Any) -> Callable[[], Callable[[], None]]:
    def disable() -> Callable[[], None]:
        old = getattr(obj, name)
        setattr(obj, name, value)
        return lambda: setattr(obj, name, old)

    return disable


def _final_logit_softcapping(lm: nn.Module) -> PostProcessing:
    cap = getattr(lm.config, "final_logit_softcapping", None)
    if cap is None:
        return PostProcessing()
    return PostProcessing(softcap=float(cap), disable=_swap_attr(lm.config, "final_logit_softcapping", None))


def _cohere_logit_scale(lm: nn.Module) -> PostProcessing:
    return PostProcessing(logit_scale=float(lm.logit_scale), disable=_swap_attr(lm, "logit_scale", 1.0))


def _granite_logits_scaling(lm: nn.Module) -> PostProcessing:
    scaling = float(lm.config.logits_scaling)
    return PostProcessing(logit_scale=1.0 / scaling, disable=_swap_attr(lm.config, "logits_scaling", 1.0))


# model_type -> reader of its post-head processing. Only architectures whose
# `ForCausalLM.forward` was read and found to apply exactly this step are listed.
POST_PROCESSING: dict[str, Callable[[nn.Module], PostProcessing]] = {
    **{
        name: _no_post_processing
        for name in (
            "llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mistral", "mixtral", "phi3",
            "gemma", "olmo", "olmo2", "smollm3", "starcoder2", "stablelm", "ministral",
        )
    },
    "gemma2": _final_logit_softcapping,
    "gemma3": _final_logit_softcapping,
    "gemma3_text": _final_logit_softcapping,
    "vaultgemma": _final_logit_softcapping,
    "cohere": _cohere_logit_scale,
    "cohere2": _cohere_logit_scale,
    "granite": _granite_logits_scaling,
    "granitemoe": _granite_logits_scaling,
}


def register_architecture(model_type: str, reader: Callable[[nn.Module], PostProcessing]) -> None:
    """Declares how a model type post-processes its logits, so `fused_head` accepts it.

    Args:
        model_type: `config.model_type` of the architecture.
        reader: Given the causal-LM module, returns its `PostProcessing`
            (`_no_post_processing` when `forward` returns `lm_head(hidden)` unchanged).
    """
    POST_PROCESSING[model_type] = reader


def post_processing_of(lm: nn.Module) -> PostProcessing:
    """The registered post-processing of `lm`, or an error naming it and the way out."""
    model_type = getattr(getattr(lm, "config", None), "model_type", None)
    reader = POST_PROCESSING.get(model_type)
    if reader is None:
        raise UnsupportedArchitectureError(
            f"fused_head does not know how {type(lm).__name__} (model_type={model_type!r}) processes "
            "its logits after lm_head, so it cannot guarantee the fused log-probs equal the model's. "
            "Train with fused_head=False (CLI: --fused_head false), or declare the architecture with "
            "fusedalign.architectures.register_architecture(model_type, reader) after checking its forward."
        )
    return reader(lm)
