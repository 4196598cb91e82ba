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
(`triton_head_backward.backward`). The chunk and block shapes are in `ops/triton_chunks.py`.

Batch-invariant mode (`ops/invariant.py`): chunk widths and row blocks above follow N, so a
row's bf16 log-prob depends on its batch-mates. With `batch_invariant` both come from the
budget and V alone (`invariant_shape`), and the forward pads every block to its full rows
(`_forward_invariant`); the backward takes the same blocks, unpadded.
"""

from __future__ import annotations

import torch
import triton  # noqa: F401  (ImportError here = backend unavailable, reported by the registry)
from torch import Tensor
from torch.autograd.function import once_differentiable

from fusedalign.ops import invariant
from fusedalign.ops.blocks import BlockForward, BlockMath
from fusedalign.ops.gemm import HALF as _HALF
from fusedalign.ops.options import HeadOptions, HeadOutput, LowRank
from fusedalign.ops.registry import Backend, register_backend
from fusedalign.ops.triton_chunks import MIN_COLS  # noqa: F401  (the backend's narrowest chunk, named here too)
from fusedalign.ops.triton_chunks import chunk_buffers, chunk_cols, chunk_logits, invariant_shape, row_blocks
from fusedalign.ops.triton_head_backward import backward
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
            g_h, g_w, g_b, g_down, g_up = backward(
                grad_logps, hidden, weight, labels, bias, down, up, lse2, ctx.opts, ent,
                need=(needs[0], needs[1], needs[3], needs[4], needs[5]),
            )
        return g_h, g_w, None, g_b, g_down, g_up, None


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
        buffers = chunk_buffers(blocks, hidden, down, v, opts)
        for r0, r1 in blocks:
            h_b, d_b = hidden[r0:r1], None if down is None else down[r0:r1]
            s_b = tuple(t[r0:r1] for t in state)  # views: the kernel folds into the block's rows
            cols = chunk_cols(r1 - r0, v, opts)
            config = launch_shape(FWD_CONFIG, r1 - r0, cols, hidden.is_cuda)
            for c0 in range(0, v, cols):
                cl = min(cols, v - c0)
                x, lx = chunk_logits(*buffers, h_b, weight, d_b, up, c0, cl)
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
    buffers = chunk_buffers([(0, rows)], hidden, down, v, opts)
    config = launch_shape(FWD_CONFIG, rows, cols, hidden.is_cuda)
    for r0 in range(0, n, rows):
        h_b = invariant.rows_into(h_buf, hidden[r0:r0 + rows])
        d_b = None if down is None else invariant.rows_into(d_buf, down[r0:r0 + rows])
        s_b = tuple(t[r0:r0 + rows] for t in state)  # views: the kernel folds into the block's rows
        for c0 in range(0, v, cols):
            cl = min(cols, v - c0)
            x, lx = chunk_logits(*buffers, h_b, w_k, d_b, up_k, c0, cl)
            fold(x, lx if down is not None else None, bias, lab[r0:r0 + rows], s_b, c0, opts, config)
    del buffers
    return finish(tuple(t[:n] for t in state), valid, labels, v, opts)


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
