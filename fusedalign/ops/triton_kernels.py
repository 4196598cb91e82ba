"""Triton kernels of the "triton" backend: the element-wise work on one logits chunk.

The GEMMs stay in cuBLAS (`torch.mm`); these kernels do everything between them, each in
a single pass over a chunk `L = [N, C]` of raw logits `h W[c0:c0+C]^T` (input dtype):

- `fwd_chunk_kernel` turns each row into a = logit_scale * (L + b + s * lora),
  z = softcap * tanh(a / softcap), y = z / T, and folds the chunk into running per-token
  state (online max and sum-exp of y, the label's y, entropy, sum of z, argmax of z),
  in base 2 (exp2 of y log2 e, the constants folded on the host: one multiply per
  element between the load and the exponential when there is no softcap);
- `bwd_chunk_kernel` overwrites L in place with the gradient
  G = logit_scale / T * (g (onehot - p) - g^H p (log p + H)) * (1 - tanh^2), p = softmax(y)
  (the entropy term only with ENTROPY_GRAD, compiled out otherwise; the softcap factor only
  with a softcap), optionally also in the LoRA buffer's dtype, and writes partial column
  sums of G for the bias gradient.

Imported lazily (by `triton_launch.py`) so that a machine without Triton never imports it.
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
def _raw_u(x, lr, b, lora_scale, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr):
    """u = x + b + s * lr in fp32 (the logits before logit_scale), in the torch backend's order."""
    u = x.to(tl.float32)
    if HAS_BIAS:
        u = u + b.to(tl.float32)
    if HAS_LORA:
        u = u + lora_scale * lr.to(tl.float32)
    return u


@triton.jit
def _log2_logits(u, logit_scale, softcap, k_u2, k_z2, HAS_SOFTCAP: tl.constexpr,
                 ACCURATE_TANH: tl.constexpr):
    """(y2, t): y2 = z / T * log2(e), the softmax argument in base 2; t = tanh(a / softcap).

    Without a softcap y2 = u * (logit_scale / T * log2 e): one multiply per element, the
    scales folded on the host. t is 0 (unused) without a softcap.
    """
    # One return statement: Triton requires every return of a function to have one type.
    if HAS_SOFTCAP:
        t = _tanh(u * logit_scale / softcap, ACCURATE_TANH)
        y2 = t * (softcap * k_z2)
    else:
        t = 0.0
        y2 = u * k_u2
    return y2, t


@triton.jit(do_not_specialize=["n_rows", "c0", "c_len", "first"])
def fwd_chunk_kernel(
    logits_ptr, stride_l, lora_ptr, stride_lr, bias_ptr, labels_ptr,
    m_ptr, s_ptr, tgt_ptr, w_ptr, zsum_ptr, zmax_ptr, amax_ptr,
    n_rows, c0, c_len, first,
    logit_scale, lora_scale, softcap, k_u2, k_z2,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr, MEAN: tl.constexpr, ARGMAX: tl.constexpr,
    ACCURATE_TANH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Fold columns [c0, c0 + c_len) of BLOCK_R rows into the per-token running state.

    All in base 2 (y2 = y log2 e), fp32, [N]: m = running max of y2; s = sum 2^(y2 - m);
    w = sum 2^(y2 - m) (y2 - m) (entropy = ln 2 (log2 s - w / s)); tgt = y2 at the label;
    zsum = sum z; zmax / amax = max of z and its first index. `first` != 0 starts the
    state instead of loading it.
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
        u = _raw_u(x, lr, b, lora_scale, HAS_BIAS, HAS_LORA)
        y2, t = _log2_logits(u, logit_scale, softcap, k_u2, k_z2, HAS_SOFTCAP, ACCURATE_TANH)
        y2 = tl.where(mask, y2, float("-inf"))
        if ARGMAX or MEAN:  # z itself, the model's logits
            if HAS_SOFTCAP:
                z = softcap * t
            else:
                z = u * logit_scale
            if ARGMAX:
                bz, bi = tl.max(tl.where(mask, z, float("-inf")), axis=1, return_indices=True,
                                return_indices_tie_break_left=True)
                better = bz > zmax  # strict: an earlier column wins ties, as in torch.argmax
                amax = tl.where(better, bi + c0 + start, amax)
                zmax = tl.where(better, bz, zmax)
            if MEAN:
                zsum += tl.sum(tl.where(mask, z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(y2, axis=1))
        m_new = tl.where(rmask, m_new, 0.0)  # rows past N: keep the arithmetic finite
        d = y2 - m_new[:, None]
        p = tl.exp2(d)  # 0 on masked columns (y2 = -inf)
        alpha = tl.exp2(m - m_new)  # 0 on the first block (m = -inf)
        if ENTROPY:
            pd = tl.sum(tl.where(mask, p * d, 0.0), axis=1)
            # w was relative to m; re-base it on m_new: 2^{m-m'} (w + (m - m') s). Before
            # the first block s = 0 and m = -inf: take (m - m') as 0 there, not -inf * 0.
            shift = tl.where(s > 0, m - m_new, 0.0)
            w = alpha * (w + shift * s) + pd
        s = s * alpha + tl.sum(p, axis=1)
        m = m_new

    # The label's y2, when the label falls in this chunk: one element per row, through the
    # same arithmetic as above so that it is bit-identical to the y2 inside the sum.
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
    ut = _raw_u(xt, lrt, bt, lora_scale, HAS_BIAS, HAS_LORA)
    yt, _ = _log2_logits(ut, logit_scale, softcap, k_u2, k_z2, HAS_SOFTCAP, ACCURATE_TANH)
    tgt = tl.where(here, yt, tgt)

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
    logits_ptr, stride_l, lora_ptr, stride_lr, bias_ptr, labels_ptr, lse2_ptr, gs_ptr,
    gh_ptr, ent_ptr, dbias_ptr, stride_db,
    n_rows, c0, c_len,
    logit_scale, lora_scale, softcap, k_u2, k_z2,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BIAS_GRAD: tl.constexpr, LORA_GRAD: tl.constexpr, ENTROPY_GRAD: tl.constexpr,
    ACCURATE_TANH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Overwrite a [BLOCK_R, BLOCK_C] tile of the raw logits with the gradient G.

    G = (gs * (onehot - p) - gh * p * (log p + H)) * (1 - tanh^2), p = 2^(y2 - lse2),
    gs = g * logit_scale / T and gh = g^H * logit_scale / T (0 where ignored), lse2 = the
    forward's log2-sum-exp2 of y2, H the forward's entropy (natural log), is
    d(sum_i g_i logp_i + g^H_i H_i) / d(raw logits); the entropy term only when
    ENTROPY_GRAD (gh_ptr, ent_ptr are read then only). It is stored in the logits buffer's
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
    lse2 = tl.load(lse2_ptr + rows, mask=rmask, other=0.0)
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
    u = _raw_u(x, lr, b, lora_scale, HAS_BIAS, HAS_LORA)
    y2, t = _log2_logits(u, logit_scale, softcap, k_u2, k_z2, HAS_SOFTCAP, ACCURATE_TANH)
    p = tl.exp2(y2 - lse2[:, None])
    onehot = (c0 + cols)[None, :] == labels[:, None]
    grad = gs[:, None] * (tl.where(onehot, 1.0, 0.0) - p)
    if ENTROPY_GRAD:
        gh = tl.load(gh_ptr + rows, mask=rmask, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=rmask, other=0.0)
        logp = (y2 - lse2[:, None]) * 0.6931471805599453  # natural log p = ln 2 * log2 p
        grad = grad - gh[:, None] * p * (logp + ent[:, None])  # dH/dy = -p (log p + H)
    if HAS_SOFTCAP:
        grad = grad * (1.0 - t * t)
    tl.store(logits_ptr + offs, grad.to(logits_ptr.dtype.element_ty), mask=mask)
    if LORA_GRAD:
        tl.store(lora_ptr + lr_offs, grad.to(lora_ptr.dtype.element_ty), mask=mask)
    if BIAS_GRAD:
        col_sum = tl.sum(tl.where(mask, grad, 0.0), axis=0)
        tl.store(dbias_ptr + pid_r * stride_db + cols, col_sum, mask=cmask)
