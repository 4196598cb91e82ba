"""LD-DPO: a completion's log-prob with its tokens past the pair's shared length down-weighted.

DPO's sequence log-prob sums every token, so a longer completion moves the margin more; LD-DPO
weighs the tokens past the shorter completion's length by alpha in [0, 1], for the policy and
the reference alike (TRL 1.16's `ld_alpha`). Every loss type then reads the weighted sums, and
so do the logged logps/* and rewards/* (as TRL's); the `sft` term alone keeps every token's
weight 1, TRL's token mean over the chosen tokens.

The sums arrive as parts, the plain sums within and past the shared length
(`data.shared_length`), so that the loss-aware head can declare them (plain sums) and the
weighting lives here, once, for the fused and the unfused path.

Paper: https://huggingface.co/papers/2409.06411

Formula:
    logp(y) = sum_{t <= l_p} log pi(y_t | ...) + alpha * sum_{t > l_p} log pi(y_t | ...),
    l_p = min(|y_w|, |y_l|)
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class WeightedSums(NamedTuple):
    """Sequence log-probs [S] of the parts of S sequences."""

    weighted: Tensor  # [S] shared + alpha * tail: what the losses score
    plain: Tensor  # [S] shared + tail: every token once (the sft term)


def ld_weighted(parts: Tensor, alpha: float) -> WeightedSums:
    """parts: [2S] the sums within the shared length (first S), then past it -> `WeightedSums`."""
    shared, tail = parts.chunk(2)
    return WeightedSums(shared + alpha * tail, shared + tail)
