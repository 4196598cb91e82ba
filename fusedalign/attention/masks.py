"""Explicit attention masks for packed rows of segments (shared prompts).

A row is a sequence of segments (`fusedalign.data.preference_batches`). Each position
carries its segment's id and the id of the one segment it also sees, its *parent* (a
shared prompt; -1 for none). Position q sees position k when

    k <= q  and  (segment[k] == segment[q]  or  segment[k] == parent[q])
            [and  position[q] - position[k] < window, on sliding-window layers]

which is causal attention confined to the row's prefix tree: a completion sees its prompt
and itself, never a sibling completion or another pair. The window is taken on
`position_ids`, as transformers takes it on positions of an unpacked row
(`kv_idx > q_idx - sliding_window`), so every layer sees what it would unshared.
"""

from __future__ import annotations

import torch
from torch import Tensor


def visibility(segment_ids: Tensor, parent_ids: Tensor, position_ids: Tensor, window: int | None = None) -> Tensor:
    """Which key each query sees, as a boolean mask for sdpa.

    Args:
        segment_ids: [R, L] long, the segment of each position.
        parent_ids: [R, L] long, the segment each position also sees (-1: none).
        position_ids: [R, L] long, the positions the model is given.
        window: the layer's sliding window, or None.

    Returns:
        [R, 1, L, L] bool, True where the query (dim 2) attends to the key (dim 3).
    """
    length = segment_ids.shape[-1]
    index = torch.arange(length, device=segment_ids.device)
    keys = segment_ids[:, None, :]  # [R, 1, L]
    mask = (keys == segment_ids[:, :, None]) | (keys == parent_ids[:, :, None])  # [R, L, L]
    mask &= index[None, :] <= index[:, None]  # causal over row order
    if window is not None:
        mask &= (position_ids[:, :, None] - position_ids[:, None, :]) < window
    return mask[:, None]


def additive_mask(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """The same mask as eager attention takes it: 0 where seen, the dtype's minimum elsewhere.

    Args:
        visible: [R, 1, L, L] bool.
    """
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)


def block_mask(segment_ids: Tensor, parent_ids: Tensor, position_ids: Tensor, window: int | None = None):
    """The same mask as a FlexAttention `BlockMask`, whose empty blocks the kernel skips.

    Args:
        segment_ids, parent_ids, position_ids: [R, L] long, as for `visibility`.

    Returns:
        A `torch.nn.attention.flex_attention.BlockMask` of shape [R, 1, L, L].
    """
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        seen = (segment_ids[b, k] == segment_ids[b, q]) | (segment_ids[b, k] == parent_ids[b, q])
        seen = seen & (k <= q)
        if window is not None:
            seen = seen & (position_ids[b, q] - position_ids[b, k] < window)
        return seen

    rows, length = segment_ids.shape
    device = segment_ids.device
    # Compiling the block-mask construction is what makes it cheap on a GPU (transformers
    # does the same); on CPU the eager construction is faster for the lengths that run there.
    return create_block_mask(mask_mod, B=rows, H=None, Q_LEN=length, KV_LEN=length, device=device,
                             _compile=device.type == "cuda")
