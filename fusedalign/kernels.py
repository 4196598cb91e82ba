"""Optional non-head kernels: Liger's RMSNorm, SwiGLU and RoPE on CUDA.

The output head is always ours (`fusedalign.head`); Liger's own loss kernels are never
applied, since they would replace the head's forward. `--use_liger_kernel` turns on the
fused head and, where liger-kernel is installed and a GPU is present, these kernels.
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
