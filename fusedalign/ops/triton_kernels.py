"""Triton kernels of the "triton" backend: the element-wise work on one logits chunk.

The GEMMs stay in cuBLAS (`torch.mm`); these kernels do everything between them, each in
a single pass over a chunk `L = [N, C]` of raw logits `h W[c0:c0+C]^T` (input dtype):

- `fwd_chunk_kernel` turns each row into a = logit_scale * (L + b + s * lora),
  z = softcap * tanh(a / softcap), y = z / T, and folds the chunk into running per-token
  state (online max and sum-exp of y, the label's y, entropy, sum of z, argmax of z);
- `bwd_chunk_kernel` overwrites L in place with the gradient
  G = g * logit_scale / T * (onehot - softmax(y)) * (1 - tanh^2)   (the softcap factor
  only with a softcap), optionally also in the LoRA buffer's dtype, and writes partial
  column sums of G for the bias gradient.

Imported lazily (by `triton_head.py`) so that a machine without Triton never imports it.
Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (tests); libdevice is then
unavailable, so tanh is computed from exp (`ACCURATE_TANH=False`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _tanh(x, ACCURATE_TANH: tl.constexpr):
    if ACCURATE_TANH:
        return libdevice.tanh(x)
    # 1 - 2 / (e^{2x} + 1): exact limits at +-inf, absolute error ~1 ulp of 1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _raw_to_a(x, lr, b, logit_scale, lora_scale, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr):
    """a = logit_scale * (x + b + s * lr), in fp32, in the order the torch backend uses."""
    a = x.to(tl.float32)
    if HAS_BIAS:
        a = a + b.to(tl.float32)
    if HAS_LORA:
        a = a + lora_scale * lr.to(tl.float32)
    return a * logit_scale


@triton.jit(do_not_specialize=["n_rows", "c0", "c_len", "first"])
def fwd_chunk_kernel(
    logits_ptr, stride_l, lora_ptr, stride_lr, bias_ptr, labels_ptr,
    m_ptr, s_ptr, tgt_ptr, w_ptr, zsum_ptr, zmax_ptr, amax_ptr,
    n_rows, c0, c_len, first,
    logit_scale, lora_scale, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr, MEAN: tl.constexpr, ARGMAX: tl.constexpr,
    ACCURATE_TANH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Fold columns [c0, c0 + c_len) of BLOCK_R rows into the per-token running state.

    State (fp32, [N]): m = running max of y; s = sum exp(y - m); w = sum exp(y - m)(y - m)
    (entropy = log s - w / s); tgt = y at the label; zsum = sum z; zmax/amax = max of z
    and its first index. `first` != 0 starts the state instead of loading it.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    rows64 = rows.to(tl.int64)
    labels = tl.load(labels_ptr + rows, mask=rmask, other=-1)  # -1 where ignored
    if first != 0:
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_R], tl.float32)
        tgt = tl.zeros([BLOCK_R], tl.float32)
        w = tl.zeros([BLOCK_R], tl.float32)
        zsum = tl.zeros([BLOCK_R], tl.float32)
        zmax = tl.full([BLOCK_R], float("-inf"), tl.float32)
        amax = tl.zeros([BLOCK_R], tl.int32)
    else:
        m = tl.load(m_ptr + rows, mask=rmask, other=0.0)
        s = tl.load(s_ptr + rows, mask=rmask, other=0.0)
        tgt = tl.load(tgt_ptr + rows, mask=rmask, other=0.0)
        w = tl.zeros([BLOCK_R], tl.float32)
        if ENTROPY:
            w = tl.load(w_ptr + rows, mask=rmask, other=0.0)
        zsum = tl.zeros([BLOCK_R], tl.float32)
        if MEAN:
            zsum = tl.load(zsum_ptr + rows, mask=rmask, other=0.0)
        zmax = tl.full([BLOCK_R], float("-inf"), tl.float32)
        amax = tl.zeros([BLOCK_R], tl.int32)
        if ARGMAX:
            zmax = tl.load(zmax_ptr + rows, mask=rmask, other=0.0)
            amax = tl.load(amax_ptr + rows, mask=rmask, other=0)

    for start in range(0, c_len, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        cmask = cols < c_len
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(logits_ptr + rows64[:, None] * stride_l + cols[None, :], mask=mask, other=0.0)
        b = 0.0
        if HAS_BIAS:
            b = tl.load(bias_ptr + c0 + cols, mask=cmask, other=0.0)[None, :]
        lr = 0.0
        if HAS_LORA:
            lr = tl.load(lora_ptr + rows64[:, None] * stride_lr + cols[None, :], mask=mask, other=0.0)
        a = _raw_to_a(x, lr, b, logit_scale, lora_scale, HAS_BIAS, HAS_LORA)
        if HAS_SOFTCAP:
            z = softcap * _tanh(a / softcap, ACCURATE_TANH)
        else:
            z = a
        z = tl.where(mask, z, float("-inf"))
        y = z * inv_temperature
        if ARGMAX:
            bz, bi = tl.max(z, axis=1, return_indices=True, return_indices_tie_break_left=True)
            better = bz > zmax  # strict: an earlier column wins ties, as in torch.argmax
            amax = tl.where(better, bi + c0 + start, amax)
            zmax = tl.where(better, bz, zmax)
            bmax = bz * inv_temperature
        else:
            bmax = tl.max(y, axis=1)
        m_new = tl.maximum(m, bmax)
        m_new = tl.where(rmask, m_new, 0.0)  # rows past N: keep the arithmetic finite
        d = y - m_new[:, None]
        p = tl.exp(d)  # 0 on masked columns (y = -inf)
        alpha = tl.exp(m - m_new)  # 0 on the first block (m = -inf)
        if ENTROPY:
            pd = tl.sum(tl.where(mask, p * d, 0.0), axis=1)
            # w was relative to m; re-base it on m_new: e^{m-m'} (w + (m - m') s). Before
            # the first block s = 0 and m = -inf: take (m - m') as 0 there, not -inf * 0.
            shift = tl.where(s > 0, m - m_new, 0.0)
            w = alpha * (w + shift * s) + pd
        s = s * alpha + tl.sum(p, axis=1)
        m = m_new
        if MEAN:
            zsum += tl.sum(tl.where(mask, z, 0.0), axis=1)

    # The label's y, when the label falls in this chunk: one element per row, through the
    # same arithmetic as above so that it is bit-identical to the y inside the sum.
    rel = labels - c0
    here = rmask & (rel >= 0) & (rel < c_len)
    rel = tl.where(here, rel, 0)
    xt = tl.load(logits_ptr + rows64 * stride_l + rel, mask=here, other=0.0)
    bt = 0.0
    if HAS_BIAS:
        bt = tl.load(bias_ptr + c0 + rel, mask=here, other=0.0)
    lrt = 0.0
    if HAS_LORA:
        lrt = tl.load(lora_ptr + rows64 * stride_lr + rel, mask=here, other=0.0)
    at = _raw_to_a(xt, lrt, bt, logit_scale, lora_scale, HAS_BIAS, HAS_LORA)
    if HAS_SOFTCAP:
        zt = softcap * _tanh(at / softcap, ACCURATE_TANH)
    else:
        zt = at
    tgt = tl.where(here, zt * inv_temperature, tgt)

    tl.store(m_ptr + rows, m, mask=rmask)
    tl.store(s_ptr + rows, s, mask=rmask)
    tl.store(tgt_ptr + rows, tgt, mask=rmask)
    if ENTROPY:
        tl.store(w_ptr + rows, w, mask=rmask)
    if MEAN:
        tl.store(zsum_ptr + rows, zsum, mask=rmask)
    if ARGMAX:
        tl.store(zmax_ptr + rows, zmax, mask=rmask)
        tl.store(amax_ptr + rows, amax, mask=rmask)


@triton.jit(do_not_specialize=["n_rows", "c0", "c_len"])
def bwd_chunk_kernel(
    logits_ptr, stride_l, lora_ptr, stride_lr, bias_ptr, labels_ptr, lse_ptr, gs_ptr,
    dbias_ptr, stride_db,
    n_rows, c0, c_len,
    logit_scale, lora_scale, softcap, inv_temperature,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BIAS_GRAD: tl.constexpr, LORA_GRAD: tl.constexpr,
    ACCURATE_TANH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Overwrite a [BLOCK_R, BLOCK_C] tile of the raw logits with the gradient G.

    G = gs * (onehot - exp(y - lse)) * (1 - tanh^2), gs = g * logit_scale / T (0 where
    ignored), is d(sum_i g_i logp_i) / d(raw logits). It is stored in the logits buffer's
    dtype (for the base GEMMs), in the LoRA buffer's dtype when LORA_GRAD, and its column
    sums over the tile's rows go to dbias[pid_r, :] (fp32) when BIAS_GRAD.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < n_rows
    cmask = cols < c_len
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    labels = tl.load(labels_ptr + rows, mask=rmask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    gs = tl.load(gs_ptr + rows, mask=rmask, other=0.0)

    offs = rows64[:, None] * stride_l + cols[None, :]
    lr_offs = rows64[:, None] * stride_lr + cols[None, :]
    x = tl.load(logits_ptr + offs, mask=mask, other=0.0)
    b = 0.0
    if HAS_BIAS:
        b = tl.load(bias_ptr + c0 + cols, mask=cmask, other=0.0)[None, :]
    lr = 0.0
    if HAS_LORA:
        lr = tl.load(lora_ptr + lr_offs, mask=mask, other=0.0)
    a = _raw_to_a(x, lr, b, logit_scale, lora_scale, HAS_BIAS, HAS_LORA)
    if HAS_SOFTCAP:
        t = _tanh(a / softcap, ACCURATE_TANH)
        y = t * (softcap * inv_temperature)
    else:
        y = a * inv_temperature
    p = tl.exp(y - lse[:, None])
    onehot = (c0 + cols)[None, :] == labels[:, None]
    grad = gs[:, None] * (tl.where(onehot, 1.0, 0.0) - p)
    if HAS_SOFTCAP:
        grad = grad * (1.0 - t * t)
    grad = tl.where(mask, grad, 0.0)
    tl.store(logits_ptr + offs, grad.to(logits_ptr.dtype.element_ty), mask=mask)
    if LORA_GRAD:
        tl.store(lora_ptr + lr_offs, grad.to(lora_ptr.dtype.element_ty), mask=mask)
    if BIAS_GRAD:
        tl.store(dbias_ptr + pid_r * stride_db + cols, tl.sum(grad, axis=0), mask=cmask)
