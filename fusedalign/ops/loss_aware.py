"""Loss-aware mode of `head_logprobs`: the head's gradient formed in its forward.

A per-token op does not know its upstream gradient in the forward, so its backward must
recompute every chunk's logits: four logits-sized GEMMs (forward, recompute, grad_h,
grad_W). The losses we train are mostly functions of per-sequence sums of log-probs that
couple only a few sequences (a DPO pair), and the reference's log-probs are known before
the policy's forward. Declared as a `SequenceLoss`, such a loss lets the op take one block
of whole groups at a time:

    L_b = h_b W^T                       one GEMM; the block's logits are kept   [R, V]
    logp, S_s = sum of s's rows          the block's sums are now complete
    c_s = dL/dS_s                        from the declared loss
    G_b = c (onehot - softmax) ...       in place over L_b
    grad_h[b] = G_b W,  grad_W += G_b^T h_b

three GEMMs, no recompute; the block's logits are bounded by a budget (whole groups of
rows x V) rather than by N x V.

Backward receives the real upstream gradient g. It must equal alpha * c_{s(i)} on every
row for one constant alpha (the caller's normaliser, a backend's loss scaling): the op
fits alpha and returns alpha times the stored gradients, all on the device. The residual
is checked once the whole backward has run (one host sync there, where a training loop
synchronises anyway): if g was not of that form, the loss was not the one declared and
the backward raises, before any optimizer could apply the gradients. A sync inside the
backward instead would stall the device while the host queues the rest of it (measured:
+20 ms of idle GPU a DPO step on an H200, more than the recompute this mode saves).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from fusedalign.ops.blocks import BlockMath
from fusedalign.ops.gemm import accumulate_mm, wide_mm
from fusedalign.ops.options import (
    BLOCK_TARGET_ROWS,
    DEFAULT_BLOCK_BUDGET_BYTES_CPU,
    DEFAULT_BLOCK_BUDGET_BYTES_CUDA,
    HeadOptions,
    HeadOutput,
    SequenceLoss,
    compute_dtype,
)

# g may differ from alpha * c by rounding only: c and g come from the same sums through
# the same loss, in fp32. A larger residual means another loss (an extra per-token term).
MATCH_RTOL = 1e-4

class DeclaredLossMismatch(RuntimeError):
    """The upstream gradient of a loss-aware call was not that of its declared SequenceLoss."""


# (residual, scale) of each loss-aware backward of the running backward pass, checked at
# its end by `_verify_pending`.
_PENDING: list[Tensor] = []


class _Plan(NamedTuple):
    """Everything non-tensor the autograd function needs, in one argument."""

    blocks: list[Tensor]  # row indices of each block, [R_b] long
    loss: SequenceLoss
    math: BlockMath  # the backend's block math (e.g. chunked.TorchBlocks)


def plan_blocks(
    loss: SequenceLoss, v: int, bytes_per_logit: int, device: torch.device, budget_bytes: int | None,
) -> list[Tensor] | None:
    """Row indices of each block (whole groups, in group order), or None when a group
    alone exceeds the budget. One host sync, which also validates the ids."""
    if budget_bytes is None:
        cuda = device.type == "cuda"
        budget_bytes = DEFAULT_BLOCK_BUDGET_BYTES_CUDA if cuda else DEFAULT_BLOCK_BUDGET_BYTES_CPU
    max_rows = budget_bytes // max(v * bytes_per_logit, 1)
    s = loss.groups.shape[0]
    # Clamped so that nothing indexes out of range before the ids are validated below.
    row_group = loss.groups.clamp(0, max(s - 1, 0)).index_select(0, loss.segments.clamp(0, max(s - 1, 0)))
    sizes = torch.zeros(s, dtype=torch.long, device=device).index_add_(0, row_group, torch.ones_like(row_group))
    ranges = torch.stack([loss.segments.min(), loss.segments.max(), loss.groups.min(), loss.groups.max()])
    seg_min, seg_max, grp_min, grp_max, *sizes = torch.cat([ranges, sizes]).tolist()
    if seg_min < 0 or seg_max >= s:
        raise ValueError(f"sequence_loss.segments must lie in [0, S) = [0, {s}) on scored rows; "
                         f"found values in [{seg_min}, {seg_max}]")
    if grp_min < 0 or grp_max >= s:
        raise ValueError(f"sequence_loss.groups must lie in [0, S) = [0, {s}); found values in [{grp_min}, {grp_max}]")
    if max(sizes, default=0) > max_rows:
        return None
    order = torch.argsort(row_group, stable=True)  # rows grouped, in their order within a group
    blocks, start, rows = [], 0, 0
    for size in sizes:
        if rows and rows + size > max_rows:
            blocks.append(order[start:start + rows])
            start, rows = start + rows, 0
        rows += size
        if rows >= BLOCK_TARGET_ROWS:
            blocks.append(order[start:start + rows])
            start, rows = start + rows, 0
    if rows:
        blocks.append(order[start:start + rows])
    return blocks


def check_sequence_loss(loss: SequenceLoss, n: int, device: torch.device) -> None:
    """Shapes, dtypes and ranges of a declared loss, with messages naming the field."""
    if not isinstance(loss, SequenceLoss):
        raise TypeError(f"sequence_loss must be a fusedalign.ops.SequenceLoss or None, got {type(loss).__name__}")
    for name, t in (("segments", loss.segments), ("groups", loss.groups)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype != torch.long:
            raise TypeError(f"sequence_loss.{name} must be a 1-D torch.long tensor, got {t!r:.80}")
        if t.device != device:
            raise ValueError(f"sequence_loss.{name} is on {t.device} but hidden is on {device}")
    if loss.segments.shape[0] != n:
        raise ValueError(f"sequence_loss.segments must be [N] = [{n}]; got {tuple(loss.segments.shape)}")
    if not callable(loss.grad):
        raise TypeError("sequence_loss.grad must be callable: sums [S] -> dL/dS [S]")


def loss_aware_head_logprobs(
    math: BlockMath, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
    loss: SequenceLoss, opts: HeadOptions, name: str, budget_bytes: int | None,
) -> HeadOutput | None:
    """The loss-aware op on scored rows only (api.py drops the ignored ones), or None when
    a group does not fit the block budget (the caller then runs the ordinary path)."""
    v = weight.shape[0]
    blocks = plan_blocks(loss, v, math.bytes_per_logit(hidden.dtype, opts), hidden.device, budget_bytes)
    if blocks is None:
        return None
    plan = _Plan(blocks, loss, math)
    logps, entropy, mean, match = _LossAwareHead.apply(hidden, weight, labels, bias, plan, opts)
    return HeadOutput(logps, entropy, mean, match, backend=name, loss_aware=True)


class _LossAwareHead(torch.autograd.Function):
    """Autograd function; `plan` and `opts` carry everything non-tensor (fixed backward arity)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, plan: _Plan, opts: HeadOptions):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
        with torch.autocast(hidden.device.type, enabled=False):
            logps, entropy, mean, match, coef, g_h, g_w, g_b = _forward(hidden, weight, labels, bias, plan, opts, need)
        ctx.save_for_backward(coef, g_h, g_w, g_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(*[t for t in (entropy, mean, match) if t is not None])
        return logps, entropy, mean, match

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps, _grad_entropy, _grad_mean, _grad_argmax):
        coef, g_h, g_w, g_b = ctx.saved_tensors
        alpha, check = _fit_scale(grad_logps, coef)
        _check_at_end_of_backward(check)
        grads = [None if acc is None else _scaled_cast(acc, alpha, dtype)
                 for acc, dtype in zip((g_h, g_w, g_b), ctx.dtypes)]
        return grads[0], grads[1], None, grads[2], None, None


def _forward(hidden, weight, labels, bias, plan: _Plan, opts: HeadOptions, need):
    n, dev = hidden.shape[0], hidden.device
    cdt = compute_dtype(hidden.dtype)
    need_h, need_w, need_b = need
    logps = torch.zeros(n, dtype=cdt, device=dev)
    coef = torch.zeros(n, dtype=cdt, device=dev)  # dL/dS of each row's sequence, as predicted
    entropy = torch.zeros(n, dtype=cdt, device=dev) if opts.entropy else None
    mean = torch.zeros(n, dtype=cdt, device=dev) if opts.logit_mean else None
    match = torch.zeros(n, dtype=torch.bool, device=dev) if opts.argmax else None
    # Gradients summed over blocks stay in fp32 (fp64 for fp64 inputs) until backward has
    # scaled them by alpha; then they are rounded once.
    g_h = torch.zeros(hidden.shape, dtype=cdt, device=dev) if need_h else None
    g_w = torch.zeros(weight.shape, dtype=cdt, device=dev) if need_w else None
    g_b = torch.zeros(bias.shape, dtype=cdt, device=dev) if need_b else None
    sums = torch.zeros(plan.loss.groups.shape[0], dtype=torch.float64, device=dev)

    for rows in plan.blocks:
        h_b, lab_b, seg_b = hidden.index_select(0, rows), labels.index_select(0, rows), plan.loss.segments.index_select(0, rows)
        fwd = plan.math.forward(h_b, weight, lab_b, bias, opts)
        lp = fwd.logps
        for dst, val in ((logps, lp), (entropy, fwd.entropy), (mean, fwd.logit_mean), (match, fwd.argmax_match)):
            if dst is not None:
                dst.index_copy_(0, rows, val.to(dst.dtype))
        # The block's sequences are complete: fp64 sums, so that the caller's own sum of
        # the same log-probs (also fp64, see DPOTrainer) rounds to the same value.
        sums.index_add_(0, seg_b, lp.double())
        with torch.enable_grad():
            dl_ds = plan.loss.grad(sums.to(cdt))
        coef_b = dl_ds.detach().to(cdt).index_select(0, seg_b)  # [R]
        coef.index_copy_(0, rows, coef_b)
        G, db = plan.math.gradient(fwd.state, lab_b, coef_b, opts, need_b)  # [R, V], input dtype
        del fwd
        if need_h:
            g_h.index_copy_(0, rows, wide_mm(G, weight, cdt))  # [R, V] @ [V, H]
        if need_w:
            accumulate_mm(g_w, G.t(), h_b)  # [V, R] @ [R, H]
        if need_b:
            g_b.add_(db)
        del G
    return logps, entropy, mean, match, coef, g_h, g_w, g_b


def _fit_scale(g: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """(alpha, [residual, scale]) on the device, no host sync: alpha fits g = alpha * c in
    least squares, residual = max |g - alpha c|, scale = max |g|."""
    g = g.to(c.dtype)
    cc = (c * c).sum()
    alpha = torch.where(cc > 0, (g * c).sum() / cc.clamp(min=torch.finfo(c.dtype).tiny), 0.0)
    return alpha, torch.stack([(g - alpha * c).abs().max(), g.abs().max()])


def _check_at_end_of_backward(check: Tensor) -> None:
    """Queues `check` for `_verify_pending`, which the autograd engine runs once the
    current backward pass is done (before `.backward()` returns)."""
    if not _PENDING:
        torch.autograd.Variable._execution_engine.queue_callback(_verify_pending)
    _PENDING.append(check.detach())


def _verify_pending() -> None:
    checks = [c.tolist() for c in _PENDING]  # the backward is queued: these syncs wait for it
    _PENDING.clear()
    for resid, scale in checks:
        if scale != scale or abs(scale) == float("inf"):
            # A non-finite upstream gradient (an overflow under fp16 loss scaling, a NaN
            # loss) is not a mismatch: alpha is non-finite too, so the returned gradients
            # are, and whatever handles that upstream (GradScaler skipping the step) does.
            continue
        if not resid <= MATCH_RTOL * scale:  # also when resid is NaN
            raise DeclaredLossMismatch(
                "fusedalign head: the upstream gradient of a loss-aware head_logprobs call is not the gradient "
                f"of its declared SequenceLoss (residual {resid:.3g} against max |gradient| {scale:.3g}), so the "
                "gradients it formed in the forward are not this loss's. They were not applied: this backward "
                "raised before any optimizer step. Declare the loss that the log-probs really feed "
                "(SequenceLoss.grad, e.g. RowLoss in fusedalign.head), or pass sequence_loss=None "
                "(DPOConfig.loss_aware_head=False) for the per-token op."
            )


def _scaled_cast(acc: Tensor, alpha: Tensor, dtype: torch.dtype, rows: int = 1 << 14) -> Tensor:
    """(alpha * acc).to(dtype), one rounding, slice by slice: no second accumulator-sized
    temporary, and the stored accumulator stays as it was (a retained graph may run again).
    alpha is a 0-d tensor on acc's device (no host sync)."""
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    flat_in, flat_out = acc.reshape(acc.shape[0], -1), out.view(acc.shape[0], -1)
    for start in range(0, acc.shape[0], rows):
        flat_out[start:start + rows] = flat_in[start:start + rows] * alpha
    return out
