"""Optional speed-ups of the backbone (never of the head, which is always ours).

- Liger's RMSNorm, SwiGLU and RoPE kernels on CUDA (`--use_liger_kernel`). Liger's own
  loss kernels are never applied, since they would replace the head's forward.
- `torch.compile` of each decoder layer's forward (`--compile_layers`, or
  `--torch_compile`). Only the layer's `forward` is compiled, not its `__call__`: the
  hooks a backend attaches to the layer (FSDP2's unshard/reshard) run eagerly around
  the compiled code, and the head, outside every layer, stays the fused op.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn
from transformers.utils import logging

from fusedalign.head import unwrap_model

logger = logging.get_logger(__name__)


def liger_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def apply_liger_kernels(model: nn.Module) -> bool:
    """Swaps the model's RMSNorm, SwiGLU MLP and RoPE for Liger's kernels, in place.

    Returns:
        Whether they were applied (False without liger-kernel or without CUDA).
    """
    if not liger_available():
        logger.info("Liger kernels not applied: they need liger-kernel installed and a CUDA device.")
        return False
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=unwrap_model(model), rms_norm=True, swiglu=True, rope=True,
        cross_entropy=False, fused_linear_cross_entropy=False,
    )
    return True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (transformers' `GradientCheckpointingLayer`s), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in unwrap_model(model).modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_decoder_layers(
    model: nn.Module, *, zero3: bool = False, backend: str = "inductor", mode: str | None = None
) -> int:
    """Replaces each decoder layer's `forward` by its `torch.compile`d version, in place.

    Every layer of a model runs the same code, so dynamo compiles it once per input
    shape signature (and once more for no-grad forwards, such as the reference's).

    Returns:
        How many layers were compiled.

    Raises:
        ValueError: under DeepSpeed ZeRO-3, whose per-module parameter hooks would have
            to run inside the compiled code; or when no decoder layer is found.
    """
    if zero3:
        raise ValueError(
            "compile_layers (--compile_layers / --torch_compile) is not supported under DeepSpeed ZeRO-3: its "
            "parameter hooks sit on every Linear inside a decoder layer, where compiled code would run them. "
            "Use it on one device, DDP, ZeRO-2 or FSDP2; under ZeRO-3 use gradient checkpointing instead."
        )
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"compile_layers: found no decoder layer (transformers GradientCheckpointingLayer) in "
            f"{type(unwrap_model(model)).__name__}; turn compile_layers off for this model."
        )
    for layer in layers:
        if not getattr(layer, "_fusedalign_compiled", False):
            layer.forward = torch.compile(layer.forward, backend=backend, mode=mode)
            layer._fusedalign_compiled = True
    return len(layers)
