"""Explicit attention masks for packed rows of segments (shared prompts; on flex attention every packed row).

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

BLOCK_SIZE = 128  # flex attention's block (torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE)
CHUNK_ELEMENTS = 1 << 26  # query-key pairs a band of `block_tables` evaluates at once (64 MiB a bool tensor)


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
    every = slice(0, segment_ids.shape[-1])
    return _seen((segment_ids, position_ids), (segment_ids, parent_ids, position_ids), window, every, every)[:, None]


def _seen(keys: tuple[Tensor, Tensor], queries: tuple[Tensor, Tensor, Tensor], window: int | None,
          query_span: slice, key_span: slice) -> Tensor:
    """The module docstring's rule for the queries in `query_span` against the keys in `key_span`.

    Args:
        keys: (segment, position) of each key position, [R, L] long each.
        queries: (segment, parent, position) of each query position, [R, L] long each.
        window: the layer's sliding window, or None.
        query_span, key_span: the row positions compared (stepless slices with a start and stop).

    Returns:
        [R, n, m] bool, True where query n sees key m.
    """
    key_segments, key_positions = (t[:, None, key_span] for t in keys)  # [R, 1, m]
    segments, parents, positions = (t[:, query_span, None] for t in queries)  # [R, n, 1]
    device = key_segments.device
    seen = (key_segments == segments) | (key_segments == parents)  # [R, n, m]
    seen &= (torch.arange(key_span.start, key_span.stop, device=device)[None, :]
             <= torch.arange(query_span.start, query_span.stop, device=device)[:, None])  # causal over row order
    if window is not None:
        seen &= (positions - key_positions) < window
    return seen


def additive_mask(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """The same mask as eager attention takes it: 0 where seen, the dtype's minimum elsewhere.

    Args:
        visible: [R, 1, L, L] bool.
    """
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)


def block_mask(segment_ids: Tensor, parent_ids: Tensor, position_ids: Tensor, window: int | None = None, *,
               block_size: int = BLOCK_SIZE, chunk_elements: int = CHUNK_ELEMENTS):
    """The same mask as a FlexAttention `BlockMask`, whose empty blocks the kernel skips.

    The block tables are computed here, eagerly, a band of query blocks at a time, and handed to
    `BlockMask.from_kv_blocks`: the same tables as `create_block_mask` makes, to the index (the
    tests compare them). `create_block_mask` is not used because it evaluates the whole [L, L]
    mask at once (int64 intermediates: tens of GiB for a 65k-token row) unless it is compiled,
    and compiled it recompiles for each new row length, each compile taking longer as rows grow:
    on an H100 (bf33ce2, 2026-12-06) the first step of one 4,224-token row a micro-batch took
    64 s, and an 8,320-token row had not left the compiler after 400 s. Here no step compiles,
    and the memory a band holds is bounded by `chunk_elements`.

    Args:
        segment_ids, parent_ids, position_ids: [R, L] long, as for `visibility`.
        window: the layer's sliding window, or None.
        block_size: the query and key block of the tables (flex attention's default, 128).
        chunk_elements: at most this many query-key pairs evaluated at once (a band is at
            least one query block of every row).

    Returns:
        A `torch.nn.attention.flex_attention.BlockMask` of shape [R, 1, L, L].
    """
    from torch.nn.attention.flex_attention import BlockMask

    def mask_mod(b, h, q, k):
        seen = (segment_ids[b, k] == segment_ids[b, q]) | (segment_ids[b, k] == parent_ids[b, q])
        seen = seen & (k <= q)
        if window is not None:
            seen = seen & (position_ids[b, q] - position_ids[b, k] < window)
        return seen

    length = segment_ids.shape[-1]
    partial, full = block_tables(segment_ids, parent_ids, position_ids, window, block_size=block_size,
                                 chunk_elements=chunk_elements)
    kv_num, kv_index = _ordered(partial)
    full_num, full_index = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_index, full_num, full_index, BLOCK_SIZE=(block_size, block_size),
                                    mask_mod=mask_mod, seq_lengths=(length, length))


def block_tables(segment_ids: Tensor, parent_ids: Tensor, position_ids: Tensor, window: int | None = None, *,
                 block_size: int = BLOCK_SIZE, chunk_elements: int = CHUNK_ELEMENTS) -> tuple[Tensor, Tensor]:
    """Which (query block, key block) pairs are partly and which wholly visible.

    Positions past L (the last block's padding) count as not visible, as in `create_block_mask`,
    so a block reaching past the row is never full.

    Returns:
        `(partial, full)`, each [R, 1, ⌈L/b⌉, ⌈L/b⌉] bool: some but not all of the block's pairs
        visible; all of them visible.
    """
    rows, length = segment_ids.shape
    blocks = -(-length // block_size)
    padded = blocks * block_size
    extra = padded - length
    # Padding positions: a segment no query has (-2; real ids and parents are >= -1), so they see
    # nothing and nothing sees them.
    pad = torch.nn.functional.pad
    positions = pad(position_ids, (0, extra))  # [R, Lp]
    keys = (pad(segment_ids, (0, extra), value=-2), positions)
    queries = (pad(segment_ids, (0, extra), value=-3), pad(parent_ids, (0, extra), value=-3), positions)
    band = max(1, chunk_elements // (rows * padded * block_size)) * block_size  # query positions a band
    partial = torch.zeros(rows, blocks, blocks, dtype=torch.bool, device=segment_ids.device)
    full = torch.zeros_like(partial)
    for start in range(0, padded, band):
        stop = min(start + band, padded)  # keys past the band's last query are never seen (causal)
        seen = _seen(keys, queries, window, slice(start, stop), slice(0, stop))  # [R, n, stop]
        tiles = seen.view(rows, (stop - start) // block_size, block_size, stop // block_size, block_size)
        some = tiles.any(dim=4).any(dim=2)  # [R, n/b, stop/b]
        every = tiles.all(dim=4).all(dim=2)
        bands = slice(start // block_size, stop // block_size)
        partial[:, bands, :stop // block_size] = some & ~every
        full[:, bands, :stop // block_size] = every
    return partial[:, None], full[:, None]


def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """A block table as flex attention reads it: the count of set blocks in each query block's
    row, and their key-block indices first, ascending (a stable sort, as `create_block_mask`)."""
    dense = dense.to(torch.int32)
    count = dense.sum(dim=-1).to(torch.int32)
    order = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return count.contiguous(), order.contiguous()
