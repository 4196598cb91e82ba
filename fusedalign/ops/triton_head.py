"""The "triton" backend: cuBLAS for the GEMMs, one Triton kernel for each chunk's element-wise work.

Same function as the "torch" backend (docs/internals.md), differently chunked: over the
*vocabulary*, not the tokens. A chunk is L = h W[c0:c0+C]^T, [N, C] in the input dtype,
for all N tokens at once; the number of logits per chunk is the torch backend's
(chunk_rows x V), so `chunk_size` / `memory_budget_bytes` mean the same amount of memory.

Forward, per chunk: L = h W_c^T (cuBLAS) -> `fwd_chunk_kernel` reads L once and folds it
into per-token running state (online max / sum-exp, label logit, entropy, sum, argmax).
Saved for backward: the inputs and the base-2 logsumexp [N] (and the entropy [N] with
`entropy_grad`).

Backward, per chunk: recompute L (cuBLAS) -> `bwd_chunk_kernel` overwrites L with
G = dlogp/dL * g (+ dH/dL * g^H with `entropy_grad`; the derivation is in `chunked.py`),
in the input dtype -> grad_W[c] = G^T h and grad_up[c] = s G^T down are
complete at once (the GEMM sums over all N tokens in fp32 and rounds once), and
grad_h += G W_c, grad_down += s G up_c accumulate over chunks in fp32.

Why the vocabulary: with a chunk of M logits, one of the two parameter-sized gradients
must be accumulated across chunks. Chunking tokens accumulates grad_W (V x H) over N V / M
chunks; chunking the vocabulary accumulates grad_h (N x H) over the same number of chunks.
While N < V this moves ~V/N times fewer bytes and needs an fp32 accumulator of N x H x 4
bytes instead of V x H x 4 (for bf16/fp16 inputs; fp32 inputs accumulate straight into
the returned gradient).

Long inputs: a chunk holds M / N columns, and every chunk re-reads all N hidden rows (and,
in backward, the N x H accumulator) for them. Once that leaves fewer than MIN_COLS columns
(N > ~57k tokens at V = 151,936 and the default budget: a DPO step of 8 pairs at 4k
tokens), the GEMMs turn memory-bound; at 1.5M tokens (8 pairs at 94k) a chunk was 38
columns wide and the op several times slower than the GEMMs it runs (docs/benchmarks.md).
So the tokens are taken in row blocks of at most M / MIN_COLS rows, each chunked over the
vocabulary as above; grad_W and the adapter's grad_up then sum over the blocks, in an fp32
V x H accumulator (0.5 GiB at Qwen2.5-0.5B's shape), which at such N is smaller than the
N x H one it replaces. The backward's two regimes are two functions behind one dispatcher
(`_backward`): `_backward_one_block` and `_backward_row_blocks`, sharing the chunk loop
`_block_chunks`.

Batch-invariant mode (`ops/invariant.py`): chunk widths and row blocks above follow N, so a
row's bf16 log-prob depends on its batch-mates. With `batch_invariant` both come from the
budget and V alone (`invariant_shape`), and the forward pads every block to its full rows
(`_forward_invariant`); the backward takes the same blocks, unpadded.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import triton  # noqa: F401  (ImportError here = backend unavailable, reported by the registry)
from torch import Tensor
from torch.autograd.function import once_differentiable

from fusedalign.ops import invariant
from fusedalign.ops.blocks import BlockForward, BlockMath
from fusedalign.ops.gemm import HALF as _HALF
from fusedalign.ops.gemm import accumulate_mm, wide_mm
from fusedalign.ops.options import HeadOptions, HeadOutput, LowRank
from fusedalign.ops.registry import Backend, register_backend
from fusedalign.ops.triton_launch import (
    BWD_BIAS_CONFIG,
    BWD_CONFIG,
    FWD_CONFIG,
    block_fwd_config,
    fill_gradient,
    finish,
    fold,
    launch_shape,
    new_state,
    on_device,
)

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


def _chunk_buffers(blocks: list[tuple[int, int]], hidden: Tensor, down: Tensor | None, v: int,
                   opts: HeadOptions) -> tuple[Tensor, Tensor | None]:
    """Reusable flat buffers for the chunks of `blocks`: the logits (hidden's dtype) and the
    adapter's logits (down's dtype, None without an adapter), each as large as the largest
    chunk any block takes (its rows x its chunk's columns)."""
    size = max((r1 - r0) * chunk_cols(r1 - r0, v, opts) for r0, r1 in blocks)
    buf = torch.empty(size, dtype=hidden.dtype, device=hidden.device)
    return buf, None if down is None else torch.empty(size, dtype=down.dtype, device=hidden.device)


class _TritonHeadLogprobs(torch.autograd.Function):
    """Autograd function; `opts` carries every non-tensor option (fixed backward arity)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, down, up, opts: HeadOptions):
        forward = _forward_invariant if opts.batch_invariant and hidden.shape[0] > 0 else _forward
        with torch.autocast(hidden.device.type, enabled=False), on_device(hidden):
            logps, entropy, mean, match, lse2 = forward(hidden, weight, labels, bias, down, up, opts)
        kept = entropy if opts.entropy_grad else None
        ctx.save_for_backward(hidden, weight, labels, bias, down, up, lse2, kept)
        ctx.opts = opts
        ctx.mark_non_differentiable(*[t for t in (entropy, mean, match) if t is not None and t is not kept])
        if opts.entropy_grad:  # an output the loss does not use gets None, not zeros: no work for it
            ctx.set_materialize_grads(False)
        return logps, entropy, mean, match

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps, grad_entropy, _grad_mean, _grad_argmax):
        hidden, weight, labels, bias, down, up, lse2, entropy = ctx.saved_tensors
        needs = ctx.needs_input_grad  # (hidden, weight, labels, bias, down, up, opts)
        if grad_logps is None:  # only the entropy feeds the loss
            grad_logps = torch.zeros_like(lse2)
        ent = None if grad_entropy is None or entropy is None else (grad_entropy, entropy)
        with torch.autocast(hidden.device.type, enabled=False), on_device(hidden):
            g_h, g_w, g_b, g_down, g_up = _backward(
                grad_logps, hidden, weight, labels, bias, down, up, lse2, ctx.opts, ent,
                need=(needs[0], needs[1], needs[3], needs[4], needs[5]),
            )
        return g_h, g_w, None, g_b, g_down, g_up, None


def _chunk_logits(buf, lbuf, hidden, weight, down, up, c0, cl):
    """L = h W_c^T (and lora = down up_c^T) into the front of the reusable buffers."""
    n = hidden.shape[0]
    x = buf[: n * cl].view(n, cl)
    torch.mm(hidden, weight[c0:c0 + cl].t(), out=x)  # [N, H] @ [H, C]
    lx = x  # a placeholder pointer when there is no adapter
    if lbuf is not None:
        lx = lbuf[: n * cl].view(n, cl)
        torch.mm(down, up[c0:c0 + cl].t(), out=lx)  # [N, r] @ [r, C]
    return x, lx


def _forward(hidden, weight, labels, bias, down, up, opts: HeadOptions):
    """Returns (logps, entropy, logit_mean, argmax_match, lse2); stats None unless asked.

    lse2 [N] is log2 sum_v 2^(y2_v), the base-2 logsumexp that backward needs.
    """
    n, v, dev = hidden.shape[0], weight.shape[0], hidden.device
    valid = labels != opts.ignore_index
    lab = torch.where(valid, labels, -1).to(torch.int32)
    state = new_state(n, opts, dev, lab)
    if n > 0:
        blocks = row_blocks(n, v, opts)
        buffers = _chunk_buffers(blocks, hidden, down, v, opts)
        for r0, r1 in blocks:
            h_b, d_b = hidden[r0:r1], None if down is None else down[r0:r1]
            s_b = tuple(t[r0:r1] for t in state)  # views: the kernel folds into the block's rows
            cols = chunk_cols(r1 - r0, v, opts)
            config = launch_shape(FWD_CONFIG, r1 - r0, cols, hidden.is_cuda)
            for c0 in range(0, v, cols):
                cl = min(cols, v - c0)
                x, lx = _chunk_logits(*buffers, h_b, weight, d_b, up, c0, cl)
                fold(x, lx if down is not None else None, bias, lab[r0:r1], s_b, c0, opts, config)
        del buffers
    return finish(state, valid, labels, v, opts)


def _forward_invariant(hidden, weight, labels, bias, down, up, opts: HeadOptions):
    """`_forward` of `batch_invariant` (`ops/invariant.py`): each row's results its own.

    Every block is exactly `rows` rows (the last one padded with zero rows, label -1) and
    every chunk `cols` columns (`invariant_shape`: from the budget and V, not N); the GEMMs
    read H (and r) zero-padded to a multiple of 16 from fresh buffers, so each cuBLAS call
    and each kernel launch has one shape whatever N is.
    """
    n, v, dev = hidden.shape[0], weight.shape[0], hidden.device
    rows, cols = invariant_shape(v, opts)
    valid = labels != opts.ignore_index
    lab = torch.full((invariant.round_up(n, rows),), -1, dtype=torch.int32, device=dev)
    lab[:n] = torch.where(valid, labels, -1)
    state = new_state(lab.shape[0], opts, dev, lab)
    w_k, up_k = invariant.k_padded(weight), None if up is None else invariant.k_padded(up)
    h_buf = hidden.new_zeros(rows, w_k.shape[1])
    d_buf = None if down is None else down.new_zeros(rows, up_k.shape[1])
    buffers = _chunk_buffers([(0, rows)], hidden, down, v, opts)
    config = launch_shape(FWD_CONFIG, rows, cols, hidden.is_cuda)
    for r0 in range(0, n, rows):
        h_b = invariant.rows_into(h_buf, hidden[r0:r0 + rows])
        d_b = None if down is None else invariant.rows_into(d_buf, down[r0:r0 + rows])
        s_b = tuple(t[r0:r0 + rows] for t in state)  # views: the kernel folds into the block's rows
        for c0 in range(0, v, cols):
            cl = min(cols, v - c0)
            x, lx = _chunk_logits(*buffers, h_b, w_k, d_b, up_k, c0, cl)
            fold(x, lx if down is not None else None, bias, lab[r0:r0 + rows], s_b, c0, opts, config)
    del buffers
    return finish(tuple(t[:n] for t in state), valid, labels, v, opts)


class _RowInputs(NamedTuple):
    """The backward kernel's per-row inputs, for the rows of one call or one row block."""

    lab: Tensor  # [n] int32, the label, -1 where ignored
    lse2: Tensor  # [n] fp32, the forward's base-2 logsumexp
    gs: Tensor  # [n] fp32, g * logit_scale / T, 0 where ignored
    gh: Tensor | None  # [n] fp32, g^H * logit_scale / T, 0 where ignored (None: no entropy gradient)
    ent: Tensor | None  # [n] fp32, the forward's entropy (None likewise)

    def rows(self, r0: int, r1: int) -> _RowInputs:
        return _RowInputs(*(None if t is None else t[r0:r1] for t in self))


def _backward(g, hidden, weight, labels, bias, down, up, lse2, opts: HeadOptions, ent=None, *, need):
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
    per_row = _RowInputs(torch.where(valid, labels, -1).to(torch.int32), lse2,
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


def _backward_one_block(hidden, weight, bias, down, up, per_row: _RowInputs, opts: HeadOptions, need):
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

    buffers = _chunk_buffers([(0, n)], hidden, down, v, opts)
    acc_h, acc_down = _block_chunks(buffers, hidden, weight, bias, down, up, per_row, opts, need, write_columns)
    if acc_down is not None:
        acc_down.mul_(opts.low_rank_scale)
    del buffers
    g_h = None if acc_h is None else acc_h.to(hidden.dtype)
    g_down = None if acc_down is None else acc_down.to(down.dtype)
    return g_h, g_w, g_b, g_down, g_up


def _backward_row_blocks(hidden, weight, bias, down, up, per_row: _RowInputs, blocks, opts: HeadOptions, need):
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
    buffers = _chunk_buffers(blocks, hidden, down, v, opts)
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


def _block_chunks(buffers, hidden, weight, bias, down, up, per_row: _RowInputs, opts: HeadOptions, need,
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
        x, lx = _chunk_logits(*buffers, hidden, weight, down, up, c0, cl)
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


class TritonBlocks(BlockMath):
    """This backend's block math for the loss-aware mode (`ops/blocks.py`, `ops/loss_aware.py`).

    A block's state is its raw logits L = h W^T, [R, V] in the input dtype (one cuBLAS
    GEMM), with the labels as int32, the bias and the base-2 logsumexp [R]; the kernels
    fold all V columns at once and then overwrite L with G in place, so the block costs
    exactly R x V logits of the input dtype.
    """

    @staticmethod
    def bytes_per_logit(dtype: torch.dtype, opts: HeadOptions) -> int:
        return dtype.itemsize

    @staticmethod
    def forward(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
                opts: HeadOptions) -> BlockForward:
        """One GEMM and one fold over all V columns (`BlockMath.forward`)."""
        with on_device(hidden):
            n, v = hidden.shape[0], weight.shape[0]
            valid = labels != opts.ignore_index
            lab = torch.where(valid, labels, -1).to(torch.int32)
            x = torch.mm(hidden, weight.t())  # [R, H] @ [H, V]
            state = new_state(n, opts, hidden.device, lab)
            fold(x, None, bias, lab, state, 0, opts, block_fwd_config(n, v, x.is_cuda))
            logps, entropy, mean, match, lse2 = finish(state, valid, labels, v, opts)
        return BlockForward((x, lab, bias, lse2), logps, entropy, mean, match)

    @staticmethod
    def gradient(state, labels: Tensor, coef: Tensor, opts: HeadOptions,
                 need_bias: bool) -> tuple[Tensor, Tensor | None]:
        """G written over the state's logits, in place (`BlockMath.gradient`)."""
        x, lab, bias, lse2 = state  # x holds h W^T; the kernels add the bias themselves
        n, v = x.shape
        with on_device(x):
            gs = torch.where(lab >= 0, coef.float(), 0.0) * (opts.logit_scale / opts.temperature)
            config = launch_shape(BWD_BIAS_CONFIG if need_bias else BWD_CONFIG, n, v, x.is_cuda)
            dbias = torch.empty(triton.cdiv(n, config[0]), v, dtype=torch.float32, device=x.device) if need_bias else None
            fill_gradient(x, None, bias, lab, lse2, gs, None, None, dbias, 0, opts, config, lora_grad=False)
        return x, (dbias.sum(dim=0) if need_bias else None)


def triton_head_logprobs(
    hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
    low_rank: LowRank | None, opts: HeadOptions,
) -> HeadOutput:
    """The "triton" backend. Inputs are validated by `head_logprobs`; shapes as there."""
    down, up = (None, None) if low_rank is None else (low_rank.down, low_rank.up)
    logps, entropy, mean, match = _TritonHeadLogprobs.apply(
        hidden, weight, labels, bias, down, up, opts
    )
    return HeadOutput(logps, entropy, mean, match, backend="triton")


def _device_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "its kernels run on CUDA devices only"
    return None


def _dtype_reason(dtype: torch.dtype) -> str | None:
    if dtype not in (torch.float32, *_HALF):
        return f"it computes in float32 and takes float32/bfloat16/float16 inputs, not {dtype}"
    return None


register_backend(
    Backend(key="triton", name="triton", run=triton_head_logprobs,
            unavailable_reason=_device_reason, dtype_reason=_dtype_reason, blocks=TritonBlocks())
)
