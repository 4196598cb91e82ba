"""How the "triton" backend cuts its work: vocabulary chunks, row blocks, their buffers and GEMMs.

The reasons (why the vocabulary, why row blocks for long inputs, batch-invariant shapes) are in
`ops/triton_head.py`'s module doc; this module holds the arithmetic both passes share.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedalign.ops import invariant
from fusedalign.ops.options import HeadOptions

# Chunk widths are rounded down to a multiple of this (GEMM- and kernel-friendly).
COL_ALIGN = 256
# The narrowest vocabulary chunk the op accepts before it splits the tokens into row
# blocks (module doc): at 1024 columns a chunk's GEMM does 1024 FLOP per byte of hidden
# it reads, well above the H200's ~200 FLOP/byte balance point.
MIN_COLS = 1024


# Batch-invariant mode: rows of a block when the budget allows (`invariant_shape`).
INVARIANT_ROWS = 8192


def invariant_shape(v: int, opts: HeadOptions) -> tuple[int, int]:
    """(rows, columns) of every chunk in batch-invariant mode, from the budget and V alone.

    About INVARIANT_ROWS rows by at least MIN_COLS (or V) columns, as many logits as the
    budget's chunk_rows x V; rows a multiple of `invariant.ROW_MULTIPLE`.
    """
    logits = opts.chunk_rows * v
    cols = min(v, max(min(MIN_COLS, v), logits // INVARIANT_ROWS))
    if cols < v and cols >= 2 * COL_ALIGN:
        cols -= cols % COL_ALIGN
    step = invariant.ROW_MULTIPLE
    return max(step, logits // cols // step * step), cols


def chunk_cols(n: int, v: int, opts: HeadOptions) -> int:
    """Vocabulary columns per chunk: chunk_rows x V logits laid out as [N, C]."""
    if opts.batch_invariant:
        return invariant_shape(v, opts)[1]
    cols = opts.chunk_rows * v // max(n, 1)
    if cols >= v:
        return v
    if cols >= 2 * COL_ALIGN:
        cols -= cols % COL_ALIGN
    return max(cols, 1)


def row_blocks(n: int, v: int, opts: HeadOptions) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) taken one after another: one block unless the budget would leave
    chunks narrower than MIN_COLS (or V) columns at n rows; then equal blocks that don't."""
    if opts.batch_invariant:  # fixed blocks (the forward pads the last one)
        rows = invariant_shape(v, opts)[0]
        return [(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)] or [(0, 0)]
    width = min(MIN_COLS, v)
    budget = opts.chunk_rows * v  # logits per chunk
    if n == 0 or budget // n >= width:
        return [(0, n)]
    count = -(-n // max(budget // width, 1))
    bounds = [i * n // count for i in range(count + 1)]  # sizes differ by at most one row
    return list(zip(bounds[:-1], bounds[1:]))


def chunk_buffers(blocks: list[tuple[int, int]], hidden: Tensor, down: Tensor | None, v: int,
                   opts: HeadOptions) -> tuple[Tensor, Tensor | None]:
    """Reusable flat buffers for the chunks of `blocks`: the logits (hidden's dtype) and the
    adapter's logits (down's dtype, None without an adapter), each as large as the largest
    chunk any block takes (its rows x its chunk's columns)."""
    size = max((r1 - r0) * chunk_cols(r1 - r0, v, opts) for r0, r1 in blocks)
    buf = torch.empty(size, dtype=hidden.dtype, device=hidden.device)
    return buf, None if down is None else torch.empty(size, dtype=down.dtype, device=hidden.device)


def chunk_logits(buf, lbuf, hidden, weight, down, up, c0, cl):
    """L = h W_c^T (and lora = down up_c^T) into the front of the reusable buffers."""
    n = hidden.shape[0]
    x = buf[: n * cl].view(n, cl)
    torch.mm(hidden, weight[c0:c0 + cl].t(), out=x)  # [N, H] @ [H, C]
    lx = x  # a placeholder pointer when there is no adapter
    if lbuf is not None:
        lx = lbuf[: n * cl].view(n, cl)
        torch.mm(down, up[c0:c0 + cl].t(), out=lx)  # [N, r] @ [r, C]
    return x, lx
