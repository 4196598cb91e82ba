"""The causal LM under its wrappers, and the keyword arguments every trainer's forward of it takes.

`unwrap_model` finds the transformers model under DDP, DeepSpeed, accelerate and PEFT wrappers
(FSDP2 changes modules in place: nothing to unwrap); `forward_inputs` is what a forward is
called with (flex attention's kernel options on a model that attends through it).
"""

from __future__ import annotations

from typing import Any

from torch import nn

# Keyword arguments of every forward a trainer runs on a model using flex attention (`forward_inputs`):
# transformers hands `kernel_options` from the forward's arguments to `flex_attention`. Left to itself,
# inductor lowers a forward without gradients whose query is under 128 tokens to flex's decoding
# kernel, meant for generation's one query a step; on a packed row under a BlockMask that kernel gave
# wrong attention (torch 2.11, H100, 2026-12-05: a 108-token shared-prompt row's log-probs without
# gradients up to 0.84 nats off sdpa's when a 166-token row had compiled first). GRPO's old-policy and
# reference passes, DPO's and KTO's reference and distillation's teacher run without gradients.
# tests/unit/test_packed_flex_gpu.py holds the case.
FLEX_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}


def flex_kernel_options(model: nn.Module) -> dict[str, Any]:
    """`{"kernel_options": FLEX_KERNEL_OPTIONS}` for a model on flex attention, else `{}`."""
    config = getattr(unwrap_model(model), "config", None)
    if getattr(config, "_attn_implementation", None) != "flex_attention":
        return {}
    return {"kernel_options": dict(FLEX_KERNEL_OPTIONS)}


def forward_inputs(model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments a trainer's forward of `model` is called with: `inputs`, and on flex
    attention `flex_kernel_options` (the caller's own `kernel_options`, if any, kept)."""
    return {**flex_kernel_options(model), **inputs, "use_cache": False}


def unwrap_model(model: nn.Module) -> nn.Module:
    """Returns the transformers model under DDP / DeepSpeed / PEFT wrappers.

    FSDP2 modifies modules in place, so there is nothing to unwrap for it.
    """
    from transformers import PreTrainedModel

    for _ in range(8):
        if hasattr(model, "get_base_model") and callable(model.get_base_model):  # PEFT
            model = model.get_base_model()
        elif not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module  # DDP, DeepSpeedEngine, accelerate wrappers
        else:
            break
    return model


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")
