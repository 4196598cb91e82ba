"""Types shared by every backend of `head_logprobs`: inputs, options, outputs, chunking.

Nothing here computes log-probs; it pins what a backend receives and returns so that a
new backend (e.g. `ops/triton_head.py`) only has to implement the math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fusedalign.ops import invariant

# Default size of ONE fp32 logits chunk [rows, V]. Peak working memory of the chunked
# backend is a small multiple of it (the chunk's logits, its probabilities / gradient,
# and a copy in the input dtype for the gradient GEMMs). On CUDA 256 MiB keeps the GEMMs
# large enough to run near peak (e.g. 441 rows at V = 151,936); on CPU smaller chunks stay
# closer to the caches and cost nothing in GEMM efficiency.
DEFAULT_BUDGET_BYTES_CUDA = 256 * 2**20
DEFAULT_BUDGET_BYTES_CPU = 32 * 2**20
# Once the whole batch does not fit the budget we split it at least this many ways, so
# that no chunk approaches half the full logits even when the budget is just too small.
MIN_CHUNKS_WHEN_SPLIT = 4
# Loss-aware mode: bytes allowed for one block's logits (whole groups of rows x V, in the
# backend's working dtype), and the rows past which a block takes no further group. One
# DPO pair at 2 x 2048 tokens and V = 151,936 is 1.1 GB in bf16.
DEFAULT_BLOCK_BUDGET_BYTES_CUDA = 4 * 2**30
DEFAULT_BLOCK_BUDGET_BYTES_CPU = 256 * 2**20
BLOCK_TARGET_ROWS = 2048


class LowRank(NamedTuple):
    """A LoRA adapter on the head: logits += scale * down @ up.T.

    Attributes:
        down: [N, r] = lora_A(dropout(hidden)), computed by the caller, so autograd
            carries its gradient on into lora_A and the hidden states.
        up: [V, r] = lora_B.weight.
        scale: lora_alpha / r (or whatever the adapter multiplies by).
    """

    down: Tensor
    up: Tensor
    scale: float


class HeadOutput(NamedTuple):
    """What `head_logprobs` returns.

    Attributes:
        logps: [N] float32 (float64 for float64 inputs), log-prob of each label; exactly 0 (and no gradient) where
            labels == ignore_index.
        entropy: [N] float32, entropy of softmax(z / T) (0 where ignored); None unless requested.
            Detached, unless the call asked for `entropy_grad`: then differentiable (ignored
            rows excepted), in every input the log-probs are.
        logit_mean: [N] float32, detached mean over the vocabulary of z (0 where ignored); None unless
            requested.
        argmax_match: [N] bool, argmax_v z == label (False where ignored); None unless requested.
        backend: which backend ran: "torch-chunked", "triton" or "reference".
        loss_aware: whether the gradient was formed in the forward from a declared
            `SequenceLoss` (three logits GEMMs instead of four).
        log_sum_sq_probs: [N] float32, detached log sum_v p_v^2 of p = softmax(z / T) (0 where
            ignored; WPO's weights); None unless requested. Last, so that the backends that
            never compute it build a `HeadOutput` as before.
    """

    logps: Tensor
    entropy: Tensor | None
    logit_mean: Tensor | None
    argmax_match: Tensor | None
    backend: str
    loss_aware: bool = False
    log_sum_sq_probs: Tensor | None = None


class SequenceLoss(NamedTuple):
    """The loss a call feeds, declared so that the op can form its gradient in the forward.

    The loss must be L = F(S), S_s = sum of the log-probs of the rows of sequence s, and
    couple sequences only within a group: dL/dS_s may depend on the sums of s's own group
    alone (a DPO pair: chosen and rejected). Anything else the caller multiplies L by (a
    global normaliser, a backend's loss scaling) is fitted in backward, where the
    declaration is also checked against the real upstream gradient (`ops/loss_aware.py`).

    Attributes:
        segments: [N] long, the sequence each row's log-prob is summed into (read on
            scored rows only).
        groups: [S] long in [0, G), the group of each sequence.
        grad: sums [S] (the log-probs' dtype) -> dL/dS [S]. It is called once per block of
            groups, with the sums of groups not yet computed set to 0; only the entries of
            the block's groups are used.
    """

    segments: Tensor
    groups: Tensor
    grad: Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class HeadOptions:
    """Every non-tensor option of the op, in one immutable object.

    It travels through `torch.autograd.Function.apply` as a single argument (as in Cut
    Cross-Entropy), so `backward` returns a short, fixed number of gradients however
    many options the op grows.
    """

    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0
    ignore_index: int = -100
    low_rank_scale: float = 0.0
    entropy: bool = False
    entropy_grad: bool = False  # implies entropy
    logit_mean: bool = False
    argmax: bool = False
    # log sum_v p_v^2, p = softmax(z / T): one more reduction per chunk (not in every backend:
    # `Backend.statistics`, `ops/registry.py`).
    log_sum_sq_probs: bool = False
    # Each row's results independent of the other rows of the call (`ops/invariant.py`).
    batch_invariant: bool = False
    chunk_rows: int = 1  # tokens per chunk; resolved from the budget before dispatch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the softmax arithmetic: fp32, or fp64 when the inputs are fp64 (tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def resolve_chunk_rows(
    n: int,
    v: int,
    device: torch.device,
    chunk_size: int | None = None,
    memory_budget_bytes: int | None = None,
    batch_invariant: bool = False,
) -> int:
    """Number of tokens per chunk.

    Args:
        n: number of tokens N.
        v: vocabulary size V.
        device: where the op runs (picks the default budget).
        chunk_size: explicit rows per chunk; wins over the budget.
        memory_budget_bytes: bytes allowed for one fp32 logits chunk [rows, V].
        batch_invariant: never depend on n (every chunk then has exactly this many rows,
            padded): the budget's rows, at most `invariant.MAX_ROWS`, rounded up to a
            multiple of `invariant.ROW_MULTIPLE` (an explicit chunk_size too).

    Returns:
        rows per chunk, >= 1.
    """
    if batch_invariant:
        rows = resolve_chunk_rows(1 << 62, v, device, chunk_size, memory_budget_bytes)  # as if N were unbounded
        if chunk_size is None:
            rows = min(rows, invariant.MAX_ROWS)
        return invariant.round_up(rows, invariant.ROW_MULTIPLE)
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        return chunk_size
    if memory_budget_bytes is None:
        cuda = device.type == "cuda"
        memory_budget_bytes = DEFAULT_BUDGET_BYTES_CUDA if cuda else DEFAULT_BUDGET_BYTES_CPU
    elif (
        isinstance(memory_budget_bytes, bool)
        or not isinstance(memory_budget_bytes, int)
        or memory_budget_bytes < 1
    ):
        raise ValueError(
            f"memory_budget_bytes must be a positive int, got {memory_budget_bytes!r}"
        )
    rows = max(1, memory_budget_bytes // (4 * v))
    if rows >= n:
        return max(n, 1)  # the whole batch fits: one chunk
    rows = min(rows, math.ceil(n / MIN_CHUNKS_WHEN_SPLIT))
    if rows >= 128:
        rows -= rows % 64  # GEMM-friendly row counts; harmless elsewhere
    return rows
