"""The attention StaticDecode decodes with: sdpa, with a decoding step's grouped query heads
read against their shared key/value heads instead of against copies of them.

A model with grouped-query attention (h query heads sharing g < h key/value heads; Qwen2.5-0.5B
has 14 and 2) decoding one token through transformers' sdpa with a padding mask copies its
whole KV cache h/g times in every layer and step (`repeat_kv`: sdpa's own GQA path refuses a
mask on CUDA), and the attention then reads the copies. On one H200 at batch 512 and context
256 (2026-12-04, 0f0ef59, `benchmarks/decode_profile.py --kernels`) those copies took 24.5 ms
of a 33 ms forward and the attention another 5.7 ms. With one query position, the h/g query
heads of a group can instead stand as h/g query *positions* of one head: [B, h, 1, d] viewed as
[B, g, h/g, d] (no copy), attending to the g heads' keys as they are, under the same mask (one
row's padding mask is the same for every head and position). The arithmetic is the same dot
products, softmaxes and sums; only the kernel's tiling differs. transformers from 5.25 does the
same in its sdpa path outside torch.compile; this one also serves 5.17, and torch.compile.

During a generation, `decoding_attention(lm)` switches a model whose attention is sdpa or flex
attention to this implementation (registered with transformers' attention and mask interfaces
under `GROUPED`) and switches it back after, whatever happens. Flex attention is what packed
training rows use on CUDA; for decoding it would build a block mask every step, and the loop
did not accept it before (such a model fell back to `generate`). Eager attention (soft-capped
models such as Gemma 2) is left as it is.

A decoding step's mask may cover only the first n slots of the static cache (StaticDecode
hands this attention such a mask: the slots written so far, rounded up for a CUDA graph); a
single query position then reads those n slots only. The slots after are masked anyway, and at
128 prompt + 2,048 new tokens reading them would cost as much as reading a full context from
the first token on. The width travels as the mask's shape, not as a setting held elsewhere, so
a compiled step sees it as a size (symbolic under dynamic shapes), not as a constant to
recompile for at every new width.

`GROUPED_TRITON` is the same with one query position computed by the Triton kernel of
`decode_kernel.py` (StaticDecode's `decode_kernel="triton"`): cuDNN's sdpa tiles a group's
query rows by 64, and the kernel holds them as one block of 16.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

GROUPED = "fusedalign_grouped_sdpa"
GROUPED_TRITON = "fusedalign_grouped_triton"
KERNELS = {"sdpa": GROUPED, "triton": GROUPED_TRITON}  # StaticDecode's decode_kernel -> implementation
KERNEL_CHOICES = ("auto", *KERNELS)  # what StaticDecode and --decode_kernel accept
SWITCHED = ("sdpa", "flex_attention")


def grouped_sdpa_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query [B, h, q, d], key and value [B, g, k, d];
    returns ([B, q, h, d], None). A single query position with g < h goes the grouped way;
    everything else (prefill, training) is transformers' sdpa. A single query position whose mask
    covers only the first n cache slots reads those n slots only."""
    return _grouped_forward(module, query, key, value, attention_mask, dropout, scaling, kwargs, kernel=False)


def grouped_triton_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[Tensor, None]:
    """`grouped_sdpa_forward`, the grouped single query position computed by the Triton kernel
    (`generation/decode_kernel.py`) where it applies (`_kernel_takes`)."""
    return _grouped_forward(module, query, key, value, attention_mask, dropout, scaling, kwargs, kernel=True)


def _grouped_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float, scaling: float | None, kwargs: dict, *, kernel: bool) -> tuple[Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    B, h, q, d = query.shape
    if q == 1 and attention_mask is not None:
        # The mask may cover only the slots written so far: leave the rest of the static cache
        # unread. (No test of the width: a compiled step would specialise on its outcome.)
        slots = attention_mask.shape[-1]
        key, value = key[:, :, :slots], value[:, :, :slots]
    per_head_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] != 1
    if (q != 1 or groups == 1 or per_head_mask or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions", False)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kernel and _kernel_takes(query, key, value, attention_mask, dropout):
        from fusedalign.generation import decode_kernel

        visible = None if attention_mask is None else attention_mask[:, 0, 0, :]  # [B, slots]
        scale = scaling if scaling is not None else d ** -0.5
        out = decode_kernel.decode_attention(query, key, value, visible, scale)  # [B, h, 1, d]
        return out.transpose(1, 2).contiguous(), None
    g = key.shape[1]
    grouped = query.reshape(B, g, h // g, d)  # the group's query heads as query positions
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling)
    return out.reshape(B, h, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _kernel_takes(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, dropout: float) -> bool:
    """Whether the Triton kernel computes this grouped step: a boolean mask (one for every head) or
    none, no dropout, a CUDA tensor (or Triton's interpreter, in tests), shapes it takes."""
    if dropout != 0.0 or not triton_runs_on(query.device):
        return False
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4
                                       or attention_mask.shape[2] != 1):
        return False
    from fusedalign.generation import decode_kernel

    return decode_kernel.supports(query, key, value) is None


def kernel_for(requested: str, device: torch.device) -> str:
    """The key of `KERNELS` a generation on `device` uses when `requested` (one of `KERNEL_CHOICES`)
    is asked for: "auto" is the Triton kernels on CUDA where Triton is installed (1.32x the
    grouped sdpa's tokens/s at batch 512, 1.19x at 256, the same peak, on an H100 at bda33d2)
    and the grouped sdpa elsewhere; "sdpa" and "triton" are themselves."""
    if requested != "auto":
        return requested
    if torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "sdpa"


def triton_runs_on(device: torch.device) -> bool:
    """Whether the project's Triton kernels run on `device`: CUDA, or any under Triton's interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def register() -> None:
    """Make `GROUPED` and `GROUPED_TRITON` names transformers' models accept as
    `config._attn_implementation` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for name, forward in ((GROUPED, grouped_sdpa_forward), (GROUPED_TRITON, grouped_triton_forward)):
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, forward)
        if name not in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def decoding_implementation(lm: nn.Module, kernel: str = "sdpa") -> str | None:
    """The attention implementation `lm` decodes with inside `decoding_attention` (`kernel`: a key
    of `KERNELS`, the grouped attention's)."""
    current = getattr(lm.config, "_attn_implementation", None)
    text = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    if current in SWITCHED and getattr(text, "attn_logit_softcapping", None) is None:
        return KERNELS[kernel]
    return current


@contextlib.contextmanager
def decoding_attention(lm: nn.Module, kernel: str = "sdpa") -> Iterator[None]:
    """`lm` (unwrapped) attends through `decoding_implementation(lm, kernel)` inside the block;
    after it, its config and every sub-config hold exactly the implementation they held before."""
    wanted = decoding_implementation(lm, kernel)
    if wanted == getattr(lm.config, "_attn_implementation", None):
        yield
        return
    register()
    configs = list(_configs(lm.config))
    before = [c._attn_implementation_internal for c in configs]
    lm.config._attn_implementation = wanted  # transformers sets the sub-configs too
    try:
        yield
    finally:
        for config, implementation in zip(configs, before):
            config._attn_implementation_internal = implementation


def _configs(config: Any) -> Iterator[Any]:
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation_internal"):
            yield from _configs(sub)
