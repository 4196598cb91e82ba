"""The block math a backend offers the loss-aware mode: the protocol between them.

The loss-aware mode (`ops/loss_aware.py`) owns the plan (which rows form a block: whole
groups of a declared `SequenceLoss`), the per-sequence sums, the call to the declared loss,
the gradient GEMMs and the autograd function. A backend owns only what happens to one
block's logits, through three methods:

    fwd = math.forward(h_b, W, labels_b, bias, opts)        # one logits GEMM; state kept
    ...  the driver sums fwd.logps into the block's sequences and asks the loss for c ...
    G, db = math.gradient(fwd.state, labels_b, c_b, opts, need_bias)   # G over the state
    grad_h[b] = G W,  grad_W += G^T h_b,  grad_b += db       # the driver's GEMMs

A backend registers an instance as `Backend.blocks` (`ops/registry.py`); one that has
none leaves it None and the op runs its ordinary per-token path instead.

Lifetime and memory. The driver calls `forward` and `gradient` once per block, in that
order, and drops its references to the state and to G before the next block's `forward`,
so exactly one block is alive at a time. `gradient` may consume the state (overwrite it
in place, return a G that aliases it); a backend keeps no reference to either after
returning. A block holds at most `block_budget_bytes / (V * bytes_per_logit)` rows, so
`bytes_per_logit` must count every logits-sized byte alive between the start of `forward`
and the end of `gradient` (the state, and any copy G needs in another dtype).

What the mode never passes (it runs the ordinary op instead, or refuses): a LoRA adapter
(`opts.low_rank_scale` is 0), `opts.entropy_grad` or `opts.batch_invariant`. It runs with
autocast disabled, on one device, with `hidden` and `weight` of one floating dtype.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from fusedalign.ops.options import HeadOptions


class BlockForward(NamedTuple):
    """What `BlockMath.forward` returns for a block of R rows.

    Attributes:
        state: opaque to the driver; handed back to `gradient` unchanged. It holds the
            block's logits in whatever form the backend needs (and anything per row the
            gradient needs, such as the logsumexp).
        logps: [R] in the compute dtype (float32, float64 for float64 inputs): the
            log-prob of each label under softmax(z / T); 0 where labels == ignore_index.
        entropy: [R] compute dtype, the entropy of softmax(z / T); None unless opts.entropy.
        logit_mean: [R] compute dtype, the mean over the vocabulary of z; None unless
            opts.logit_mean.
        argmax_match: [R] bool, argmax_v z == label (False where ignored); None unless
            opts.argmax.
    """

    state: Any
    logps: Tensor
    entropy: Tensor | None
    logit_mean: Tensor | None
    argmax_match: Tensor | None


@runtime_checkable
class BlockMath(Protocol):
    """One backend's math on a block of whole groups (the loss-aware mode's backend half).

    Notation, as in docs/internals.md: u = h W^T + b (the raw logits), a = logit_scale * u,
    z = softcap * tanh(a / softcap) (z = a without a softcap), y = z / T, p = softmax(y).
    Every tensor lives on hidden's device.
    """

    def bytes_per_logit(self, dtype: torch.dtype, opts: HeadOptions) -> int:
        """Bytes per logit of one block while it is alive (its state plus G's copy).

        Args:
            dtype: the dtype of hidden and weight.
            opts: the call's options (a softcap may need a second buffer).

        Returns:
            a positive int; the driver sizes blocks as budget // (V * this).
        """
        ...

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
                opts: HeadOptions) -> BlockForward:
        """The block's logits (one GEMM), its log-probs and the statistics opts asks for.

        Args:
            hidden: [R, H] the block's hidden states (contiguous), dtype of weight.
            weight: [V, H] the output embedding (any strides).
            labels: [R] long in [0, V), or opts.ignore_index (such a row must give logp 0
                and, in `gradient`, a zero row of G).
            bias: [V] or None, any floating dtype.
            opts: temperature, softcap, logit_scale, ignore_index and the statistics flags.

        Returns:
            BlockForward; its state keeps what `gradient` needs, so that no logits GEMM
            is recomputed.
        """
        ...

    def gradient(self, state: Any, labels: Tensor, coef: Tensor, opts: HeadOptions,
                 need_bias: bool) -> tuple[Tensor, Tensor | None]:
        """G = d(sum_i coef_i logp_i) / du over the block, formed from the kept state.

            G[i, j] = coef_i * logit_scale / T * (onehot_ij - p_ij) * (1 - tanh^2(a_ij / softcap))

        (the last factor only with a softcap); 0 on rows whose label is ignore_index.

        Args:
            state: `forward`'s state for this block; may be consumed.
            labels: [R] the labels passed to `forward`.
            coef: [R] compute dtype: dL/dS of each row's sequence (any value, 0 included).
            opts: the options passed to `forward`.
            need_bias: whether to return the bias gradient's column sums.

        Returns:
            (G [R, V] in hidden's dtype, for the driver's GEMMs; may alias the state,
            db [V] in the compute dtype = column sums of G before rounding, or None
            unless need_bias).
        """
        ...
