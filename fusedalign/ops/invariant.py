"""Batch-invariant mode (`batch_invariant=True`): the shapes that make a row's results its own.

No arithmetic of the op mixes two rows, yet a row's bits can depend on its batch-mates:
a BLAS library picks its kernel (cuBLAS its split of K) by the problem's shape, treats rows
in edge tiles differently from the others, and vectorises by alignment; the backends size
their chunks from N. GRPO scores the same completions in different batches (the old
policy, the policy) and needs the first-iteration ratio to be exactly 1, so in this mode
every backend computes each row in a shape that does not depend on N:

- every GEMM has a fixed number of rows R (a torch chunk, a Triton row block), the last
  chunk padded with zero rows; R is a multiple of ROW_MULTIPLE;
- the GEMMs' reduction dimension (H, the adapter's rank) is zero-padded to a multiple of
  K_MULTIPLE, in fresh contiguous buffers (adding zeros changes no partial sum);
- vocabulary chunk widths (Triton) come from the budget and V, never from N;
- the torch backend's softmax reductions run over rows padded to a multiple of
  COL_MULTIPLE columns (at PAD_LOGIT), so that every row starts equally aligned.

Why these multiples (measured on this repository's 2-core CI CPU, MKL, 2026-12-03): with
the shape fixed, a row's fp32 logits still differed with its position for 5 to 11 rows,
fp64 ones for row counts not a multiple of 4 and for small odd H at any count; with R a
multiple of 8 and H padded to 16, no position differed in ~1,800 shapes (fp32, fp64, bf16,
fp16). On CUDA a fixed shape runs one cuBLAS algorithm, which splits K alike for every tile
(the CUDA tests check the result bit for bit). Gradients are not made invariant: they are
sums over rows.
"""

from __future__ import annotations

from torch import Tensor

ROW_MULTIPLE = 8
K_MULTIPLE = 16
COL_MULTIPLE = 64
# Rows of one torch chunk at most (a small vocabulary's budget would allow far more; every
# call, even of one row, pays for R rows).
MAX_ROWS = 256
# The softmax input of padding columns: exp underflows to exactly 0, and 0 * (PAD - max)
# stays 0 in the entropy's sum (with -inf it would be NaN).
PAD_LOGIT = -1e30


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def k_padded(t: Tensor) -> Tensor:
    """t [M, K] contiguous with K zero-padded to a multiple of K_MULTIPLE (t itself if it is one)."""
    k = t.shape[1]
    kp = round_up(max(k, 1), K_MULTIPLE)
    if kp == k and t.is_contiguous():
        return t
    out = t.new_zeros(t.shape[0], kp)
    out[:, :k] = t
    return out


def rows_into(buf: Tensor, src: Tensor) -> Tensor:
    """Copies src [k, K] into the first k rows and K columns of buf [R, Kp], zeros the rest.

    Returns buf: a GEMM operand of R rows whatever k is, at the same (fresh) address each call.
    """
    k, width = src.shape
    buf[:k, :width] = src
    buf[k:].zero_()
    return buf
