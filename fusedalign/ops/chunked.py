"""The "torch" backend: chunked over tokens in plain PyTorch (CPU and GPU).

Forward: for each chunk of `rows` tokens build that chunk's logits [rows, V], take the
log-prob of each label, the logsumexp and any requested statistics, and drop the chunk.
It saves only the inputs and the per-token logsumexp. Backward recomputes each chunk's
logits from the inputs and turns them straight into the gradient of the chunk, so no
tensor of N x V elements ever exists. The cost is one extra logits GEMM (the recompute):
a per-token op cannot fold its backward into its forward, because the upstream gradient
is unknown until backward.

Math, with a = logit_scale * (h W^T + b + s * down up^T), z = c * tanh(a / c) (or z = a
without a softcap), y = z / T and p = softmax(y):

    logp_i          = y[i, label_i] - logsumexp(y_i)
    d logp_i / d a_ij = (onehot_ij - p_ij) / T * (1 - tanh^2(a_ij / c))

and every parameter gradient follows from G = g_i * logit_scale * d logp_i / d a_ij by
one GEMM each (h: G W, W: G^T h, b: sum_i G, down: s G up, up: s G^T down).

With `entropy_grad` the entropy H_i = -sum_j p_ij log p_ij carries a gradient too. From
d log p_ik / d y_ij = onehot_jk - p_ij,

    d H_i / d y_ij = -sum_k p_ik (onehot_jk - p_ij)(log p_ik + 1) = -p_ij (log p_ij + H_i)

so an upstream gradient g^H_i on the entropy adds its term next to the log-prob's:

    G_ij = logit_scale / T * (1 - tanh^2(a_ij / c)) * (g_i (onehot_ij - p_ij) - g^H_i p_ij (log p_ij + H_i))

(the tanh factor only with a softcap). The backward then needs H [N] from the forward, and
one more [rows, V] buffer per chunk (p next to log p).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from fusedalign.ops import invariant
from fusedalign.ops.blocks import BlockForward, BlockMath
from fusedalign.ops.gemm import wide_mm
from fusedalign.ops.options import HeadOptions, HeadOutput, LowRank, compute_dtype
from fusedalign.ops.registry import Backend, register_backend


def _scaled_logits(
    h: Tensor, weight: Tensor, bias: Tensor | None, down: Tensor | None, up: Tensor | None,
    opts: HeadOptions, cdt: torch.dtype,
) -> Tensor:
    """a = logit_scale * (h W^T + b + s * down up^T) for one chunk: [n, V], fresh, in `cdt`.

    The GEMMs run in the input dtype (tensor cores for bf16); everything after them runs
    in `cdt` (fp32, or fp64 for fp64 inputs) because the softmax needs the precision.
    """
    a = torch.mm(h, weight.t()).to(cdt)  # [n, H] @ [H, V]; .to is a no-op when dtypes match
    if bias is not None:
        a.add_(bias.to(cdt))
    if down is not None:
        a.add_(torch.mm(down, up.t()).to(cdt), alpha=opts.low_rank_scale)  # [n, r] @ [r, V]
    if opts.logit_scale != 1.0:
        a.mul_(opts.logit_scale)
    return a


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """Autograd function; `opts` carries every non-tensor option (fixed backward arity)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, down, up, opts: HeadOptions):
        # Autocast is resolved by the caller (api.py casts the inputs); inside, the
        # softmax must stay in fp32 whatever autocast would choose.
        with torch.autocast(hidden.device.type, enabled=False):
            out = (_forward_invariant if opts.batch_invariant else _forward)(hidden, weight, labels, bias, down, up, opts)
        entropy = out[1] if opts.entropy_grad else None
        ctx.save_for_backward(hidden, weight, labels, bias, down, up, out[-1], entropy)
        ctx.opts = opts
        stats = [t for t in out[1:5] if t is not None and t is not entropy]
        ctx.mark_non_differentiable(*stats)
        if opts.entropy_grad:  # an output the loss does not use gets None, not zeros: no work for it
            ctx.set_materialize_grads(False)
        return out[:5]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps, grad_entropy, _grad_mean, _grad_argmax, _grad_sum_sq):
        hidden, weight, labels, bias, down, up, lse, entropy = ctx.saved_tensors
        needs = ctx.needs_input_grad  # (hidden, weight, labels, bias, down, up, opts)
        if grad_logps is None:  # only the entropy feeds the loss
            grad_logps = torch.zeros_like(lse)
        ent = None if grad_entropy is None or entropy is None else (grad_entropy, entropy)
        with torch.autocast(hidden.device.type, enabled=False):
            grads = _backward(
                grad_logps, hidden, weight, labels, bias, down, up, lse, ctx.opts, ent,
                need_h=needs[0], need_w=needs[1], need_b=needs[3],
                need_down=needs[4], need_up=needs[5],
            )
        g_h, g_w, g_b, g_down, g_up = grads
        return g_h, g_w, None, g_b, g_down, g_up, None


def _forward(hidden, weight, labels, bias, down, up, opts: HeadOptions):
    """Returns (logps, entropy, logit_mean, argmax_match, log_sum_sq_probs, lse); stats None unless asked."""
    n, dev = hidden.shape[0], hidden.device
    cdt = compute_dtype(hidden.dtype)
    valid = labels != opts.ignore_index
    safe = labels.masked_fill(~valid, 0)  # ignored labels become index 0: never out of range
    logps = torch.zeros(n, dtype=cdt, device=dev)
    lse = torch.empty(n, dtype=cdt, device=dev)
    entropy = torch.empty(n, dtype=cdt, device=dev) if opts.entropy else None
    mean = torch.empty(n, dtype=cdt, device=dev) if opts.logit_mean else None
    match = torch.empty(n, dtype=torch.bool, device=dev) if opts.argmax else None
    sum_sq = torch.empty(n, dtype=cdt, device=dev) if opts.log_sum_sq_probs else None
    T, c = opts.temperature, opts.softcap

    for start in range(0, n, opts.chunk_rows):
        sl = slice(start, start + opts.chunk_rows)
        y = _scaled_logits(
            hidden[sl], weight, bias, None if down is None else down[sl], up, opts, cdt
        )
        if c is not None:
            y.div_(c).tanh_().mul_(c)  # z, in place
        if T != 1.0:
            y.div_(T)  # y = z / T, in place; the statistics below undo T where they need z
        logps[sl], lse[sl], *stats = _chunk_forward(y, safe[sl], valid[sl], opts)
        for dst, val in zip((entropy, mean, match, sum_sq), stats):
            if dst is not None:
                dst[sl] = val
    return logps, entropy, mean, match, sum_sq, lse


def _forward_invariant(hidden, weight, labels, bias, down, up, opts: HeadOptions):
    """`_forward` of `batch_invariant` (`ops/invariant.py`): each row's results its own.

    Every chunk is exactly R = chunk_rows rows (the last one padded with zero rows), its
    GEMMs reduce over H (and r) zero-padded to a multiple of 16 from fresh buffers, and its
    softmax runs over rows padded to a multiple of 64 columns at PAD_LOGIT: one shape and
    one alignment for every row whatever N is.
    """
    n, dev = hidden.shape[0], hidden.device
    cdt, rows, v = compute_dtype(hidden.dtype), opts.chunk_rows, weight.shape[0]
    valid = labels != opts.ignore_index
    safe = labels.masked_fill(~valid, 0)
    w_k, up_k = invariant.k_padded(weight), None if up is None else invariant.k_padded(up)
    h_buf = hidden.new_zeros(rows, w_k.shape[1])
    d_buf = None if down is None else down.new_zeros(rows, up_k.shape[1])
    y = torch.empty(rows, invariant.round_up(v, invariant.COL_MULTIPLE), dtype=cdt, device=dev)
    y[:, v:] = invariant.PAD_LOGIT
    pad_safe, pad_valid = safe.new_zeros(rows), valid.new_zeros(rows)
    outs = [torch.zeros(n, dtype=cdt, device=dev), torch.empty(n, dtype=cdt, device=dev)]  # logps, lse
    outs += [torch.empty(n, dtype=t, device=dev) if wanted else None
             for t, wanted in ((cdt, opts.entropy), (cdt, opts.logit_mean), (torch.bool, opts.argmax),
                               (cdt, opts.log_sum_sq_probs))]
    for start in range(0, n, rows):
        sl, k = slice(start, start + rows), min(rows, n - start)
        z = y[:, :v]  # the real columns, in place
        z.copy_(torch.mm(invariant.rows_into(h_buf, hidden[sl]), w_k.t()))  # [R, Hp] @ [Hp, V]
        if bias is not None:
            z.add_(bias.to(cdt))
        if down is not None:
            z.add_(torch.mm(invariant.rows_into(d_buf, down[sl]), up_k.t()).to(cdt), alpha=opts.low_rank_scale)
        if opts.logit_scale != 1.0:
            z.mul_(opts.logit_scale)
        if opts.softcap is not None:
            z.div_(opts.softcap).tanh_().mul_(opts.softcap)
        if opts.temperature != 1.0:
            z.div_(opts.temperature)
        chunk = _chunk_forward(y, invariant.rows_into(pad_safe[:, None], safe[sl, None]).squeeze(1),
                               invariant.rows_into(pad_valid[:, None], valid[sl, None]).squeeze(1), opts, width=v)
        for dst, val in zip(outs, chunk):  # (logps, lse, entropy, logit_mean, argmax_match, log_sum_sq_probs)
            if dst is not None:
                dst[sl] = val[:k]
    logps, lse, entropy, mean, match, sum_sq = outs
    return logps, entropy, mean, match, sum_sq, lse


def _chunk_forward(y: Tensor, safe: Tensor, valid: Tensor, opts: HeadOptions, width: int | None = None):
    """(logps, lse, entropy, logit_mean, argmax_match, log_sum_sq_probs) of one chunk's y = z / T [n, V].

    Statistics are None unless requested; y is read, never written. `width`: the real
    columns of a y padded at PAD_LOGIT beyond them (batch-invariant mode); None: all.
    """
    T = opts.temperature
    m = y.amax(dim=1, keepdim=True)  # [n, 1]: shift so exp never overflows
    d = y - m if opts.entropy else None  # [n, V]
    e = d.exp() if d is not None else torch.sub(y, m).exp_()  # [n, V], in (0, 1], 1 at the max
    s = e.sum(dim=1)
    # log sum_v p_v^2 = logsumexp(2y) - 2 logsumexp(y) = log sum_v e_v^2 - 2 log s: one more
    # reduction over the chunk; both sums are >= 1 (the max's term), so neither underflows.
    sum_sq = torch.linalg.vecdot(e, e).log() - 2 * s.log() if opts.log_sum_sq_probs else None
    entropy = None
    if opts.entropy:
        # H = lse - E_p[y] = log s - E_p[y - m]: the shifted form avoids cancelling
        # two large numbers when the logits are large.
        entropy = s.log() - e.mul_(d).sum(dim=1) / s
    del d, e
    lse = m.squeeze(1) + s.log()
    target = y.gather(1, safe[:, None]).squeeze(1)
    logps = torch.where(valid, target - lse, 0.0)
    if opts.logit_mean:
        mean = (y.mean(dim=1) if width is None else y[:, :width].sum(dim=1) / width) * T
    else:
        mean = None
    # argmax of z equals argmax of z / T because T > 0.
    match = (y.argmax(dim=1) == safe) & valid if opts.argmax else None
    return logps, lse, entropy, mean, match, sum_sq


def _softmax_input(a: Tensor, opts: HeadOptions) -> tuple[Tensor, Tensor | None]:
    """(y, t) from a chunk's scaled logits a [n, V], in place over a: y = z / T, and
    t = tanh(a / softcap), kept for the gradient's chain rule (None without a softcap)."""
    T, c = opts.temperature, opts.softcap
    if c is not None:
        t = a.div_(c).tanh_()  # z = c * t
        return t * (c / T), t
    return (a.div_(T) if T != 1.0 else a), None


def _chunk_gradient(y: Tensor, t: Tensor | None, lse: Tensor, gs: Tensor, safe: Tensor,
                    ent: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """G = (gs (onehot - p) - gh p (log p + H)) (1 - t^2), p = softmax(y), in place over y [n, V].

    t = tanh(a / softcap) (None without a softcap) is consumed; gs [n] already holds
    g * logit_scale / T and is 0 on ignored rows; ent = (gh, H) [n], gh = g^H * logit_scale / T
    (0 on ignored rows), or None without an entropy gradient.
    """
    gs = gs[:, None]  # [n, 1]
    if ent is None:
        G = y.sub_(lse[:, None]).exp_().mul_(-gs)  # -g p, in place over y: [n, V]
    else:
        gh, entropy = ent
        logp = y.sub_(lse[:, None])  # in place over y
        p = logp.exp()
        G = logp.add_(entropy[:, None]).mul_(gh[:, None]).add_(gs).mul_(p).neg_()  # -p (gs + gh (log p + H))
        del p
    G.scatter_add_(1, safe[:, None], gs)  # + g onehot (gs is 0 on ignored rows)
    if t is not None:
        G.mul_(t.square_().neg_().add_(1.0))  # softcap chain rule: 1 - tanh^2
    return G


def _backward(g, hidden, weight, labels, bias, down, up, lse, opts: HeadOptions, ent=None,
              *, need_h: bool, need_w: bool, need_b: bool, need_down: bool, need_up: bool):
    """Gradients (hidden, weight, bias, down, up) of sum_i g_i logp_i (+ g^H_i H_i when ent =
    (g^H [N], H [N]) is given); None where not needed."""
    n, dev = hidden.shape[0], hidden.device
    cdt = compute_dtype(hidden.dtype)
    T = opts.temperature
    valid = labels != opts.ignore_index
    safe = labels.masked_fill(~valid, 0)
    # Ignored positions get exactly zero gradient, even if the upstream sent NaN there.
    gs = torch.where(valid, g.to(cdt), 0.0) * (opts.logit_scale / T)  # [N]
    if ent is not None:
        ent = (torch.where(valid, ent[0].to(cdt), 0.0) * (opts.logit_scale / T), ent[1])

    # Contiguous row-major buffers, so each chunk's rows are one block for `out=`.
    g_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=dev) if need_h else None
    # Parameter gradients are sums over every token: accumulate them in fp32 (fp64 for
    # fp64 inputs) across chunks, and cast once at the end.
    g_w = torch.zeros(weight.shape, dtype=cdt, device=dev) if need_w else None
    g_b = torch.zeros(bias.shape, dtype=cdt, device=dev) if need_b else None
    g_down = torch.empty(down.shape, dtype=down.dtype, device=dev) if need_down else None
    g_up = torch.zeros(up.shape, dtype=cdt, device=dev) if need_up else None

    for start in range(0, n, opts.chunk_rows):
        sl = slice(start, start + opts.chunk_rows)
        h_c, down_c = hidden[sl], None if down is None else down[sl]
        y, t = _softmax_input(_scaled_logits(h_c, weight, bias, down_c, up, opts, cdt), opts)
        G = _chunk_gradient(y, t, lse[sl], gs[sl], safe[sl], None if ent is None else (ent[0][sl], ent[1][sl]))
        del t
        # G = d(sum g logp) / d(h W^T + b + s down up^T) for this chunk, in cdt.
        G_in = G.to(hidden.dtype)  # GEMMs in the input dtype, like the forward
        if need_h:
            torch.mm(G_in, weight, out=g_h[sl])  # [n, V] @ [V, H]
        if need_w:
            g_w.add_(wide_mm(G_in.t(), h_c, cdt))  # [V, n] @ [n, H]
        if need_b:
            g_b.add_(G.sum(dim=0))
        if need_down or need_up:
            G_lr = G.to(down.dtype)
            if need_down:
                torch.mm(G_lr, up, out=g_down[sl]).mul_(opts.low_rank_scale)  # [n, V] @ [V, r]
            if need_up:
                g_up.add_(wide_mm(G_lr.t(), down_c, cdt), alpha=opts.low_rank_scale)
        del y, G, G_in

    cast = lambda acc, like: None if acc is None else acc.to(like.dtype)  # noqa: E731
    return g_h, cast(g_w, weight), cast(g_b, bias), g_down, cast(g_up, up)


class TorchBlocks(BlockMath):
    """This backend's block math for the loss-aware mode (`ops/blocks.py`, `ops/loss_aware.py`).

    A block's state is y = z / T in the compute dtype [R, V] (and tanh(a / softcap) with a
    softcap) plus the logsumexp of y [R], so its memory is 4 bytes per logit (8 with a
    softcap), plus the gradient's copy in the input dtype.
    """

    @staticmethod
    def bytes_per_logit(dtype: torch.dtype, opts: HeadOptions) -> int:
        cdt = compute_dtype(dtype).itemsize
        return cdt * (2 if opts.softcap is not None else 1) + (dtype.itemsize if dtype.itemsize < cdt else 0)

    @staticmethod
    def forward(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
                opts: HeadOptions) -> BlockForward:
        """One GEMM for the block's rows, then its statistics (`BlockMath.forward`)."""
        cdt = compute_dtype(hidden.dtype)
        y, t = _softmax_input(_scaled_logits(hidden, weight, bias, None, None, opts, cdt), opts)  # [R, V]
        valid = labels != opts.ignore_index
        logps, lse, entropy, mean, match, _ = _chunk_forward(y, labels.masked_fill(~valid, 0), valid, opts)
        return BlockForward((y, t, lse, hidden.dtype), logps, entropy, mean, match)

    @staticmethod
    def gradient(state, labels: Tensor, coef: Tensor, opts: HeadOptions,
                 need_bias: bool) -> tuple[Tensor, Tensor | None]:
        """G over the state's y, returned in the input dtype (`BlockMath.gradient`)."""
        y, t, lse, dtype = state
        valid = labels != opts.ignore_index
        gs = torch.where(valid, coef.to(y.dtype), 0.0) * (opts.logit_scale / opts.temperature)
        G = _chunk_gradient(y, t, lse, gs, labels.masked_fill(~valid, 0))
        return G.to(dtype), (G.sum(dim=0) if need_bias else None)


def chunked_head_logprobs(
    hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
    low_rank: LowRank | None, opts: HeadOptions,
) -> HeadOutput:
    """The "torch" backend. Inputs are validated by `head_logprobs`; shapes as there."""
    down, up = (None, None) if low_rank is None else (low_rank.down, low_rank.up)
    logps, entropy, mean, match, sum_sq = _ChunkedHeadLogprobs.apply(
        hidden, weight, labels, bias, down, up, opts
    )
    return HeadOutput(logps, entropy, mean, match, backend="torch-chunked", log_sum_sq_probs=sum_sq)


register_backend(Backend(key="torch", name="torch-chunked", run=chunked_head_logprobs, blocks=TorchBlocks(),
                         statistics=frozenset({"log_sum_sq_probs"})))
