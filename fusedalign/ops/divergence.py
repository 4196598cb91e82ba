"""The generalised Jensen-Shannon divergence between a student head and a teacher head, fused.

On-policy distillation scores every completion token by how far the student's next-token
distribution is from the teacher's. Both distributions come from an output head over the
whole vocabulary, so the unfused computation holds two N x V logits tensors (and their
softmaxes); this op holds one block of rows x columns of each at a time.

Definitions (TRL's `DistillationTrainer`, trl/trainer/distillation_trainer.py at huggingface/trl
02061a9, read 2026-12-04), per scored token i, with each model's own post-processing
(a = logit_scale * (h W^T + b [+ s down up^T]), z = softcap * tanh(a / softcap)) and its
temperature y = z / T:

    s = log_softmax(y_student),  t = log_softmax(y_teacher),  p = exp(s),  q = exp(t)
    beta = 0:  D = KL(q || p) = sum_j q_j (t_j - s_j)                        (forward KL)
    beta = 1:  D = KL(p || q) = sum_j p_j (s_j - t_j)                        (reverse KL)
    else:      m = (1 - beta) p + beta q
               D = beta KL(q || m) + (1 - beta) KL(p || m)                    (generalised JSD)

Its gradient in the student's y (the teacher gets none), from d s_j / d y_k = onehot_jk - p_k:

    beta = 0:  dD/dy_k = p_k - q_k
    otherwise: dD/dy_k = p_k (g_k - E_p[g]),  g = s - t (beta = 1), g = (1 - beta)(s - log m) (else)

since D depends on p through sum_j p_j g_j-like terms whose own derivative in p vanishes in
expectation (d/dp_j of -sum m log m gives -(1 - beta)(log m_j + 1)). E_p[g] is D for beta = 1
and (1 - beta) KL(p || m) otherwise: the forward saves it per token [N].

Blocks. Tokens are taken `chunk_rows` at a time; the vocabulary `chunk_cols` at a time. With
one vocabulary block a row chunk's logits are built once in the forward (its logsumexps and
terms from the same block). With several, the forward makes two passes over the vocabulary
(an online logsumexp of both models, then the divergence's terms), and the backward one
(recomputing both models' logits, turning the student's into its gradient block by block).

A teacher vocabulary larger than the student's (padded embedding rows, e.g. Qwen2.5-7B's
152,064 against 0.5B's 151,936): the student's logits beyond its vocabulary are -inf, so
p = 0 there and those columns enter only through the teacher's softmax and the mixture. For
beta = 0 that makes D infinite wherever the teacher puts mass beyond the student's
vocabulary, so the op refuses it; a student vocabulary larger than the teacher's is refused
for the same reason (`divergence_head` says which and why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from fusedalign.ops.gemm import accumulate_mm, wide_mm
from fusedalign.ops.options import compute_dtype


@dataclass(frozen=True)
class HeadSpec:
    """One model's logit post-processing and temperature (non-tensor, frozen)."""

    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0


@dataclass(frozen=True)
class DivergenceOptions:
    """Every non-tensor option of the divergence op, through `autograd.Function` as one argument."""

    beta: float = 1.0
    student: HeadSpec = HeadSpec()
    teacher: HeadSpec = HeadSpec()
    low_rank_scale: float = 0.0
    chunk_rows: int = 1
    chunk_cols: int = 1


class DivergenceOutput(NamedTuple):
    """What `divergence_head` returns.

    Attributes:
        divergence: [N] compute dtype (float32, float64 for float64 inputs): D of each token,
            exactly 0 (and no gradient) where labels == ignore_index.
        entropy: [N] the student's entropy under softmax(z / T), detached; 0 where ignored.
        backend: "torch-chunked" or "reference".
    """

    divergence: Tensor
    entropy: Tensor
    backend: str


def _softmax_input(h: Tensor, weight: Tensor, bias: Tensor | None, down: Tensor | None, up: Tensor | None,
                   low_rank_scale: float, spec: HeadSpec, cdt: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """(y, tanh(a / softcap) or None) of one block: y = z / T [n, c] in `cdt`, from the GEMM in the input dtype.

    Works in place on the GEMM's own output (a fresh tensor): one [n, c] block in `cdt`, two with a softcap.
    """
    a = torch.mm(h, weight.t()).to(cdt)  # [n, H] @ [H, c]
    if bias is not None:
        a.add_(bias)
    if down is not None:
        accumulate_mm(a, down * low_rank_scale, up.t())  # [n, r] @ [r, c], into the block
    if spec.logit_scale != 1.0:
        a.mul_(spec.logit_scale)
    if spec.softcap is None:
        return a.div_(spec.temperature), None
    t = a.div_(spec.softcap).tanh_()
    return t * (spec.softcap / spec.temperature), t


class _Block(NamedTuple):
    """One rows x columns block of both models: y [n, c] each (student -inf beyond its vocabulary).

    Its tensors are the block's own: `_values` and `_grad_u` overwrite them.
    """

    ys: Tensor
    tanh_s: Tensor | None
    yt: Tensor
    student_cols: int  # how many of the block's columns the student has


def _block(hs, ws, bs, down, up, ht, wt, bt, cols: slice, opts: DivergenceOptions, cdt) -> _Block:
    vs = ws.shape[0]
    s_end = min(cols.stop, vs)
    width = cols.stop - cols.start
    yt, _ = _softmax_input(ht, wt[cols], None if bt is None else bt[cols], None, None, 0.0, opts.teacher, cdt)
    if s_end <= cols.start:
        return _Block(torch.full_like(yt, -math.inf), None, yt, 0)
    sc = slice(cols.start, s_end)
    ys, tanh_s = _softmax_input(hs, ws[sc], None if bs is None else bs[sc], down, None if up is None else up[sc],
                                opts.low_rank_scale, opts.student, cdt)
    if s_end - cols.start < width:  # the teacher's extra columns: -inf for the student
        ys = torch.cat([ys, ys.new_full((ys.shape[0], width - ys.shape[1]), -math.inf)], dim=1)
    return _Block(ys, tanh_s, yt, s_end - cols.start)


# Memory. A block's math runs on [n, c] tensors in the compute dtype; each step below overwrites
# one the block no longer needs, so that at most three are alive at once for beta 0 or 1 (the
# student's and the teacher's log-probs and one more), four for the mixture, one more with a
# softcap (the student's tanh), forward and backward (tests/unit/test_divergence.py holds the
# bound; before 2026-12-05 it was 12 to 15). Products with the student's p where the student
# has no column (p = 0, s = -inf) are NaN in IEEE arithmetic and 0 in the math: those columns
# are a contiguous tail, zeroed.


def _log_probs(ys: Tensor, yt: Tensor, lse_s: Tensor, lse_t: Tensor) -> tuple[Tensor, Tensor]:
    """(s, t) [n, c]: the block's log-softmaxes, in place of its y's.

    lse_s, lse_t: [n, 2] each model's logsumexp as (row max, log sum exp(y - max)): subtracting the
    max first, as log_softmax does, keeps the log-probs' rounding at the scale of log V, not of |y|.
    """
    return ys.sub_(lse_s[:, :1]).sub_(lse_s[:, 1:]), yt.sub_(lse_t[:, :1]).sub_(lse_t[:, 1:])


def _row_sum(x: Tensor, student_cols: int) -> Tensor:
    """Sum over the block's columns of a product with the student's p: its missing columns count 0."""
    if student_cols < x.shape[1]:
        x[:, student_cols:] = 0.0
    return x.sum(1)


def _log_mixture(s: Tensor, t: Tensor, beta: float) -> Tensor:
    """log m = log((1 - beta) p + beta q) [n, c], a new tensor (one more alive while it is made)."""
    log_m = s + math.log1p(-beta)
    return torch.logaddexp(log_m, t + math.log(beta), out=log_m)


def _values(block: _Block, lse_s: Tensor | None, lse_t: Tensor | None, beta: float):
    """Per-row sums over one block: (D, E_p[g] or None for beta = 0, the student's entropy) [n] each,
    and the logsumexps (computed here from the block, which then holds whole rows, when None).

    Consumes the block: pass it as a temporary, so that its tensors go as soon as they are used."""
    if lse_s is None:
        lse_s, lse_t = _max_and_log_sum(block.ys), _max_and_log_sum(block.yt)
    s, t = _log_probs(block.ys, block.yt, lse_s, lse_t)
    cols = block.student_cols
    del block
    if beta == 0.0:  # D = sum q (t - s): the op refuses a student missing columns the teacher has
        q = t.exp()
        d = t.sub_(s).mul_(q).sum(1)
        del q, t
        p = s.exp()
    elif beta == 1.0:  # D = sum p (s - t)
        p = s.exp()
        d = _row_sum(t.sub_(s).mul_(p), cols).neg_()
        del t
    else:  # D = beta sum q (t - log m) + (1 - beta) sum p (s - log m)
        log_m = _log_mixture(s, t, beta)
        q = t.exp()
        d_teacher = t.sub_(log_m).mul_(q).sum(1)
        del q, t
        p = s.exp()
        kl_student = _row_sum(log_m.sub_(s).mul_(p), cols).neg_()  # sum p (s - log m)
        del log_m
        d = beta * d_teacher + (1.0 - beta) * kl_student
    entropy = _row_sum(s.mul_(p), cols).neg_()
    expected_g = None if beta == 0.0 else (d if beta == 1.0 else (1.0 - beta) * kl_student)
    return d, expected_g, entropy, lse_s, lse_t


def _grad_u(block: _Block, lse_s: Tensor, lse_t: Tensor, expected_g: Tensor | None, beta: float) -> Tensor:
    """dD/du [n, c] of one block, u the student's head output before its softcap (0 on its missing
    columns): dD/dy times the softcap's derivative. Consumes the block: pass it as a temporary."""
    s, t = _log_probs(block.ys, block.yt, lse_s, lse_t)
    cols, tanh = block.student_cols, block.tanh_s
    del block
    if beta == 0.0:  # p - q
        G = s.exp_().sub_(t.exp_())
    else:
        if beta == 1.0:  # g = s - t
            p = s.exp()
            g = s.sub_(t)
            del t
        else:  # g = (1 - beta)(s - log m)
            log_m = _log_mixture(s, t, beta)
            del t
            p = s.exp()
            g = s.sub_(log_m).mul_(1.0 - beta)
            del log_m
        G = g.sub_(expected_g[:, None]).mul_(p)  # p (g - E_p[g])
        del p
        if cols < G.shape[1]:
            G[:, cols:] = 0.0
    if tanh is not None:
        G.mul_(tanh.square_().neg_().add_(1.0))  # the softcap's chain rule
    return G


def _col_blocks(v: int, cols: int) -> list[slice]:
    return [slice(c, min(c + cols, v)) for c in range(0, v, cols)]


def _max_and_log_sum(y: Tensor) -> Tensor:
    """[n, 2]: (max_j y_j, log sum_j exp(y_j - max)) of a block holding whole rows."""
    m = y.amax(1)
    return torch.stack([m, (y - m[:, None]).exp_().sum(1).log()], 1)


def _logsumexps(hs, ws, bs, down, up, ht, wt, bt, opts, cdt, blocks):
    """Online logsumexp of both models over the vocabulary blocks: ([n, 2], [n, 2]) as `_max_and_log_sum`."""
    n = hs.shape[0]
    m = [hs.new_full((n,), -math.inf, dtype=cdt) for _ in range(2)]
    acc = [hs.new_zeros((n,), dtype=cdt) for _ in range(2)]
    for cols in blocks:
        blk = _block(hs, ws, bs, down, up, ht, wt, bt, cols, opts, cdt)
        for k, y in enumerate((blk.ys, blk.yt)):
            new_m = torch.maximum(m[k], y.amax(1))
            # exp(-inf - -inf) would be NaN: a row whose running max is still -inf has acc 0.
            rescale = torch.where(torch.isinf(m[k]), 0.0, (m[k] - new_m).exp())
            acc[k] = acc[k] * rescale + (y - new_m[:, None]).exp_().sum(1)
            m[k] = new_m
    return torch.stack([m[0], acc[0].log()], 1), torch.stack([m[1], acc[1].log()], 1)


def _forward(hs, ws, bs, down, up, ht, wt, bt, opts: DivergenceOptions):
    """(D, E_p[g], entropy [N] each, lse_s, lse_t [N, 2] each), in the compute dtype."""
    n, cdt = hs.shape[0], compute_dtype(hs.dtype)
    out = [hs.new_zeros((n,), dtype=cdt) for _ in range(3)] + [hs.new_zeros((n, 2), dtype=cdt) for _ in range(2)]
    blocks = _col_blocks(wt.shape[0], opts.chunk_cols)
    for start in range(0, n, opts.chunk_rows):
        r = slice(start, start + opts.chunk_rows)
        args = (hs[r], ws, bs, None if down is None else down[r], up, ht[r], wt, bt)
        if len(blocks) == 1:  # one pass: the block's logits serve the logsumexps and the terms
            parts = [_values(_block(*args, blocks[0], opts, cdt), None, None, opts.beta)]
            lse_s, lse_t = parts[0][3:]
        else:
            lse_s, lse_t = _logsumexps(*args, opts, cdt, blocks)
            parts = [_values(_block(*args, cols, opts, cdt), lse_s, lse_t, opts.beta) for cols in blocks]
        out[0][r] = sum(p[0] for p in parts)
        if opts.beta != 0.0:
            out[1][r] = sum(p[1] for p in parts)
        out[2][r] = sum(p[2] for p in parts)
        out[3][r], out[4][r] = lse_s, lse_t
    return tuple(out)


class _ChunkedDivergence(torch.autograd.Function):
    """Differentiable in the student's hidden, weight, bias, LoRA down and up; never the teacher's."""

    @staticmethod
    def forward(ctx, hs, ws, bs, down, up, ht, wt, bt, opts: DivergenceOptions):
        with torch.autocast(hs.device.type, enabled=False):
            d, expected_g, entropy, lse_s, lse_t = _forward(hs, ws, bs, down, up, ht, wt, bt, opts)
        ctx.save_for_backward(hs, ws, bs, down, up, ht, wt, bt, expected_g, lse_s, lse_t)
        ctx.opts = opts
        ctx.mark_non_differentiable(entropy)
        return d, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_d, _grad_entropy):
        hs, ws, bs, down, up, ht, wt, bt, expected_g, lse_s, lse_t = ctx.saved_tensors
        need = ctx.needs_input_grad
        with torch.autocast(hs.device.type, enabled=False):
            grads = _backward(grad_d, hs, ws, bs, down, up, ht, wt, bt, expected_g, lse_s, lse_t, ctx.opts,
                              need=(need[0], need[1], need[2], need[3], need[4]))
        return (*grads, None, None, None, None)


def _backward(g, hs, ws, bs, down, up, ht, wt, bt, expected_g, lse_s, lse_t, opts: DivergenceOptions, need):
    """Gradients (hidden, weight, bias, down, up) of sum_i g_i D_i; None where not needed."""
    n, vs, cdt = hs.shape[0], ws.shape[0], compute_dtype(hs.dtype)
    spec = opts.student
    g = g.to(cdt) * (spec.logit_scale / spec.temperature)  # [N]: d/dy -> d/du, but for the softcap's factor
    g_h = torch.zeros(hs.shape, dtype=cdt, device=hs.device) if need[0] else None
    g_w = torch.zeros(ws.shape, dtype=cdt, device=hs.device) if need[1] else None
    g_b = torch.zeros(bs.shape, dtype=cdt, device=hs.device) if need[2] else None
    g_down = torch.zeros(down.shape, dtype=cdt, device=hs.device) if need[3] else None
    g_up = torch.zeros(up.shape, dtype=cdt, device=hs.device) if need[4] else None
    blocks = _col_blocks(vs, opts.chunk_cols)  # the student's gradient lives on its own columns only
    for start in range(0, n, opts.chunk_rows):
        r = slice(start, start + opts.chunk_rows)
        h_r, down_r = hs[r], None if down is None else down[r]
        for cols in blocks:
            G = _grad_u(_block(h_r, ws, bs, down_r, up, ht[r], wt, bt, cols, opts, cdt), lse_s[r], lse_t[r],
                        None if expected_g is None else expected_g[r], opts.beta)
            G.mul_(g[r, None])
            G_in = G.to(hs.dtype)  # [n, c]: dL/du, the GEMMs in the input dtype
            if g_h is not None:
                accumulate_mm(g_h[r], G_in, ws[cols])  # [n, c] @ [c, H]
            if g_w is not None:
                accumulate_mm(g_w[cols], G_in.t(), h_r)  # [c, n] @ [n, H], no [c, H] temporary
            if g_b is not None:
                g_b[cols] += G.sum(0)
            if g_down is not None:
                g_down[r] += opts.low_rank_scale * wide_mm(G_in.to(down.dtype), up[cols], cdt)  # [n, c] @ [c, r]
            if g_up is not None:
                g_up[cols] += opts.low_rank_scale * wide_mm(G_in.t().to(down.dtype), down_r, cdt)
            del G, G_in  # before the next block is made
    cast = lambda acc, like: None if acc is None else acc.to(like.dtype)  # noqa: E731
    return cast(g_h, hs), cast(g_w, ws), cast(g_b, bs), cast(g_down, down), cast(g_up, up)


def chunked_divergence(hs, ws, bs, down, up, ht, wt, bt, opts: DivergenceOptions) -> DivergenceOutput:
    """The chunked backend on scored rows; inputs validated by `divergence_head`."""
    # The teacher is a fixed target: whatever its tensors carry, no gradient reaches them.
    d, entropy = _ChunkedDivergence.apply(hs, ws, bs, down, up, ht.detach(), wt.detach(),
                                          None if bt is None else bt.detach(), opts)
    return DivergenceOutput(d, entropy, "torch-chunked")
