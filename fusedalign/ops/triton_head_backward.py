"""The "triton" backend's backward (`ops/triton_head.py` has the why): recompute each chunk's
logits, let `bwd_chunk_kernel` overwrite them with G, and take the gradients from G with cuBLAS.

Two regimes behind one dispatcher (`backward`), following the forward's row blocks
(`triton_chunks.row_blocks`): `_backward_one_block` and `_backward_row_blocks`, sharing the
chunk loop `_block_chunks`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import triton
from torch import Tensor

from fusedalign.ops.gemm import HALF as _HALF
from fusedalign.ops.gemm import accumulate_mm, wide_mm
from fusedalign.ops.options import HeadOptions
from fusedalign.ops.triton_chunks import chunk_buffers, chunk_cols, chunk_logits, row_blocks
from fusedalign.ops.triton_launch import BWD_BIAS_CONFIG, BWD_CONFIG, fill_gradient, launch_shape


class RowInputs(NamedTuple):
    """The backward kernel's per-row inputs, for the rows of one call or one row block."""

    lab: Tensor  # [n] int32, the label, -1 where ignored
    lse2: Tensor  # [n] fp32, the forward's base-2 logsumexp
    gs: Tensor  # [n] fp32, g * logit_scale / T, 0 where ignored
    gh: Tensor | None  # [n] fp32, g^H * logit_scale / T, 0 where ignored (None: no entropy gradient)
    ent: Tensor | None  # [n] fp32, the forward's entropy (None likewise)

    def rows(self, r0: int, r1: int) -> RowInputs:
        return RowInputs(*(None if t is None else t[r0:r1] for t in self))


def backward(g, hidden, weight, labels, bias, down, up, lse2, opts: HeadOptions, ent=None, *, need):
    """Gradients (hidden, weight, bias, down, up) of sum_i g_i logp_i (+ g^H_i H_i when ent =
    (g^H [N], H [N]) is given); None where not needed.

    The dispatcher of the two regimes, which follow the forward's row blocks (`row_blocks`):
    one block of every row (`_backward_one_block`) or several (`_backward_row_blocks`).
    """
    n, v = hidden.shape[0], weight.shape[0]
    valid = labels != opts.ignore_index
    # Ignored positions get exactly zero gradient, even if the upstream sent NaN there.
    scale = opts.logit_scale / opts.temperature
    gh = None if ent is None else torch.where(valid, ent[0].float(), 0.0) * scale
    per_row = RowInputs(torch.where(valid, labels, -1).to(torch.int32), lse2,
                         torch.where(valid, g.float(), 0.0) * scale, gh, None if ent is None else ent[1])
    if n == 0:
        return _backward_no_rows(hidden, weight, bias, down, up, need)
    blocks = row_blocks(n, v, opts)
    if len(blocks) == 1:
        return _backward_one_block(hidden, weight, bias, down, up, per_row, opts, need)
    return _backward_row_blocks(hidden, weight, bias, down, up, per_row, blocks, opts, need)


def _backward_no_rows(hidden, weight, bias, down, up, need):
    """No rows: empty per-row gradients, zero per-column ones (still connected)."""
    need_h, need_w, need_b, need_down, need_up = need
    like = lambda t, wanted: torch.empty_like(t) if wanted else None  # noqa: E731
    zeros = lambda t, wanted: torch.zeros(t.shape, dtype=t.dtype, device=t.device) if wanted else None  # noqa: E731
    return like(hidden, need_h), zeros(weight, need_w), zeros(bias, need_b), like(down, need_down), zeros(up, need_up)


def _backward_one_block(hidden, weight, bias, down, up, per_row: RowInputs, opts: HeadOptions, need):
    """Every row at once, chunked over the vocabulary (up to ~57k rows at V = 151,936).

    A chunk's column gradients (grad_W, grad_b, grad_up of its columns) are complete after
    its GEMM, which sums over all N rows in fp32 and rounds once: they are written straight
    into the returned tensors. grad_h and grad_down accumulate over the chunks (in fp32 for
    half inputs) and are cast once the chunk buffer is freed, so that the peak stays one
    chunk plus one accumulator.
    """
    _, need_w, need_b, _, need_up = need
    n, v = hidden.shape[0], weight.shape[0]
    g_w, g_b, g_up = (torch.empty(t.shape, dtype=t.dtype, device=t.device) if wanted else None
                      for t, wanted in ((weight, need_w), (bias, need_b), (up, need_up)))

    def write_columns(cols: slice, x: Tensor, lx: Tensor, dbias: Tensor | None) -> None:
        if g_w is not None:
            torch.mm(x.t(), hidden, out=g_w[cols])  # [C, N] @ [N, H]
        if g_b is not None:
            g_b[cols] = dbias[:, :x.shape[1]].sum(dim=0)
        if g_up is not None:
            g_up[cols] = wide_mm(lx.t(), down).mul_(opts.low_rank_scale)  # [C, N] @ [N, r]

    buffers = chunk_buffers([(0, n)], hidden, down, v, opts)
    acc_h, acc_down = _block_chunks(buffers, hidden, weight, bias, down, up, per_row, opts, need, write_columns)
    if acc_down is not None:
        acc_down.mul_(opts.low_rank_scale)
    del buffers
    g_h = None if acc_h is None else acc_h.to(hidden.dtype)
    g_down = None if acc_down is None else acc_down.to(down.dtype)
    return g_h, g_w, g_b, g_down, g_up


def _backward_row_blocks(hidden, weight, bias, down, up, per_row: RowInputs, blocks, opts: HeadOptions, need):
    """Long inputs: the forward's row blocks one after another, each chunked over the vocabulary.

    Column gradients are summed over the blocks in fp32 accumulators (grad_W: V x H) and
    rounded once at the end. Each block's grad_h / grad_down rows are written into the
    returned tensors when the block is done, and its fp32 accumulator is freed before the
    next block allocates its own.
    """
    need_h, need_w, need_b, need_down, need_up = need
    v = weight.shape[0]
    g_h = torch.empty_like(hidden) if need_h else None
    g_down = torch.empty_like(down) if need_down else None
    acc_w, acc_b, acc_up = (_acc_like(t) if wanted else None
                            for t, wanted in ((weight, need_w), (bias, need_b), (up, need_up)))
    buffers = chunk_buffers(blocks, hidden, down, v, opts)
    for r0, r1 in blocks:
        h_b, d_b = hidden[r0:r1], None if down is None else down[r0:r1]

        def add_columns(cols: slice, x: Tensor, lx: Tensor, dbias: Tensor | None, h_b=h_b, d_b=d_b) -> None:
            if acc_w is not None:
                accumulate_mm(acc_w[cols], x.t(), h_b)  # [C, n] @ [n, H]
            if acc_b is not None:
                acc_b[cols] += dbias[:, :x.shape[1]].sum(dim=0)
            if acc_up is not None:
                accumulate_mm(acc_up[cols], lx.t(), d_b)  # [C, n] @ [n, r]; scaled at the end

        acc_h, acc_down = _block_chunks(buffers, h_b, weight, bias, d_b, up, per_row.rows(r0, r1), opts, need,
                                        add_columns)
        if acc_h is not None:
            g_h[r0:r1] = acc_h
        if acc_down is not None:
            g_down[r0:r1] = acc_down.mul_(opts.low_rank_scale)
        del acc_h, acc_down  # freed before the next block allocates its own
    del buffers
    if acc_up is not None:
        acc_up.mul_(opts.low_rank_scale)
    cast = lambda acc, like: None if acc is None else acc.to(like.dtype)  # noqa: E731
    return g_h, cast(acc_w, weight), cast(acc_b, bias), g_down, cast(acc_up, up)


def _acc_like(t: Tensor) -> Tensor:
    """A zeroed running sum: fp32 for a half-precision tensor, t's own dtype otherwise."""
    return torch.zeros(t.shape, dtype=torch.float32 if t.dtype in _HALF else t.dtype, device=t.device)


def _block_chunks(buffers, hidden, weight, bias, down, up, per_row: RowInputs, opts: HeadOptions, need,
                  columns: Callable[[slice, Tensor, Tensor, Tensor | None], None]):
    """One row block's vocabulary chunks, shared by both regimes.

    Per chunk: recompute L (and the adapter's logits), let the kernel overwrite them with G,
    add G W_c (and s G up_c) into the block's fp32 grad_h (grad_down) rows, and hand the
    chunk to `columns(cols, G, G in the adapter's dtype, dbias)` for its column gradients.

    Returns:
        (grad_h rows, grad_down rows before the adapter's scale) of the block, fp32 for
        half inputs; None where not needed.
    """
    need_h, _, need_b, need_down, need_up = need
    n, v = hidden.shape[0], weight.shape[0]
    acc_h = _acc_like(hidden) if need_h else None
    acc_down = _acc_like(down) if need_down else None
    cols = chunk_cols(n, v, opts)
    config = launch_shape(BWD_BIAS_CONFIG if need_b else BWD_CONFIG, n, cols, hidden.is_cuda)
    dbias = torch.empty(triton.cdiv(n, config[0]), cols, dtype=torch.float32, device=hidden.device) if need_b else None
    for c0 in range(0, v, cols):
        cl = min(cols, v - c0)
        x, lx = chunk_logits(*buffers, hidden, weight, down, up, c0, cl)
        fill_gradient(x, lx if down is not None else None, bias, *per_row, dbias, c0, opts, config,
                      lora_grad=need_down or need_up)
        # x now holds G [n, C] (input dtype); lx holds G in the adapter's dtype.
        chunk = slice(c0, c0 + cl)
        if need_h:
            accumulate_mm(acc_h, x, weight[chunk])  # [n, C] @ [C, H]
        columns(chunk, x, lx, dbias)
        if need_down:
            accumulate_mm(acc_down, lx, up[chunk])  # [n, C] @ [C, r]
    return acc_h, acc_down
