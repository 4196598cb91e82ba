"""Public entry points of `fusedalign.ops`: validation, autocast, backend dispatch."""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

# Importing the built-in backends registers them.
from fusedalign.ops import chunked as _chunked  # noqa: F401
from fusedalign.ops import reference as _reference  # noqa: F401
from fusedalign.ops.loss_aware import check_sequence_loss, loss_aware_head_logprobs
from fusedalign.ops.options import HeadOptions, HeadOutput, LowRank, SequenceLoss, resolve_chunk_rows
from fusedalign.ops.registry import resolve_backend


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    low_rank: LowRank | None = None,
    entropy: bool = False,
    entropy_grad: bool = False,
    logit_mean: bool = False,
    argmax: bool = False,
    log_sum_sq_probs: bool = False,
    chunk_size: int | None = None,
    memory_budget_bytes: int | None = None,
    backend: str = "auto",
    sequence_loss: SequenceLoss | None = None,
    block_budget_bytes: int | None = None,
    batch_invariant: bool = False,
) -> HeadOutput:
    """Per-token log-probabilities of `labels` under the output head, without N x V logits.

    Computes, for every token i,

        a = logit_scale * (hidden @ weight.T + bias + s * down @ up.T)      # [N, V]
        z = softcap * tanh(a / softcap)   (z = a when softcap is None)       # the logits
        logps[i] = log_softmax(z[i] / temperature)[labels[i]]

    chunk by chunk, so that memory stays bounded by `memory_budget_bytes` rather than
    N x V. Differentiable in hidden, weight, bias, low_rank.down and low_rank.up.

    Args:
        hidden: [N, H] final hidden states (flatten batch and sequence first).
        weight: [V, H] output embedding, same dtype as `hidden`.
        labels: [N] integer, the token scored at each position; `ignore_index` where
            nothing is scored. Those rows are not computed at all: they give exactly 0
            (and False) in every output and no gradient.
        bias: [V] output bias, or None.
        temperature: divides z before the softmax; > 0.
        softcap: final-logit soft-capping value (Gemma 2 style), or None.
        logit_scale: multiplies the logits before the softcap (e.g. Cohere's logit_scale).
        ignore_index: label value meaning "not scored".
        low_rank: a LoRA adapter on the head (down [N, r], up [V, r], scale), or None.
        entropy: also return the entropy H of softmax(z / temperature), detached.
        entropy_grad: also return H, differentiable (implies `entropy`): an upstream
            gradient g^H on it adds, per logit, with p = softmax(z / T),

                d/dz_j [g^H H] = g^H * (-(p_j / T) * (log p_j + H))

            next to the log-prob's g * (onehot_j - p_j) / T; both then pass through the
            softcap's 1 - tanh^2(a_j / softcap) and logit_scale to the inputs. Ignored rows
            get no gradient from either. Not with `sequence_loss` (ValueError).
        logit_mean: also return the mean of z over the vocabulary, detached.
        argmax: also return whether argmax(z) == label.
        log_sum_sq_probs: also return log sum_v p_v^2, p = softmax(z / temperature), detached
            (= logsumexp(2 z / T) - 2 logsumexp(z / T); WPO's weights). The Triton kernels do
            not compute it: "auto" then runs the chunked "torch" backend, and backend="triton"
            is refused (BackendUnavailableError). Not with `sequence_loss` (ValueError).
        chunk_size: tokens per chunk; overrides `memory_budget_bytes`.
        memory_budget_bytes: bytes for one fp32 logits chunk [rows, V] (default 256 MiB
            on CUDA, 32 MiB elsewhere); peak extra memory is a small multiple of it. The
            "triton" backend chunks the vocabulary instead, keeping the same number of
            logits per chunk in the input dtype (half the budget for bf16), plus an fp32
            [N, H] accumulator for the hidden-state gradient of bf16/fp16 inputs.
        backend: "auto" ("triton" on CUDA when Triton is installed and the dtype is
            fp32/bf16/fp16, else "torch"), "torch" (chunked PyTorch), "reference"
            (unfused, materialises z) or "triton" (cuBLAS GEMMs + Triton kernels, CUDA).
        sequence_loss: the loss these log-probs feed, when it is a function of per-sequence
            sums coupled only within groups (`SequenceLoss`; segments [N]). With it, and
            gradients wanted, the backends that can ("torch", "triton") form the gradient
            in the forward, a block of whole groups at a time: three logits GEMMs instead
            of four (`ops/loss_aware.py`). The declaration is checked against the real
            upstream gradient when the backward pass ends, which raises
            `DeclaredLossMismatch` if they differ. Not used with low_rank, by "reference",
            without gradients, or when one group alone exceeds `block_budget_bytes`.
            Refused with `entropy_grad`: a loss with an entropy term is not a function of
            the sequence sums alone, which is what the declaration promises; and with
            `log_sum_sq_probs`, which the block math does not compute (its one user, WPO,
            weighs each pair's loss by it, so that loss is not known before the forward).
        block_budget_bytes: bytes for one block's logits in the loss-aware mode (default
            4 GiB on CUDA, 256 MiB elsewhere). Peak extra memory is that block plus fp32
            [N, H] and [V, H] gradients held from forward to backward.
        batch_invariant: make each row's results (log-prob and statistics) bit for bit
            independent of the other rows of the call, as GRPO needs when it scores the
            same completions in different batches: every backend then computes in shapes
            that do not depend on N (`ops/invariant.py`: chunks / row blocks of a fixed
            number of rows, the last one padded, `chunk_size` rounded up to a multiple of
            8; fixed vocabulary chunk widths). Costs the padding of the last chunk.
            Gradients are not made invariant. Refused with `sequence_loss` (its blocks
            follow the batch's groups).

    Returns:
        HeadOutput with `logps` [N] float32 and the requested statistics ([N] float32, or
        bool for `argmax_match`; detached, except the entropy with `entropy_grad`), the name
        of the backend that ran and whether the loss-aware mode ran.

    Raises:
        ValueError: a shape, value or backend name is wrong (the message names it).
        TypeError: a dtype or argument type is wrong.
        BackendUnavailableError: the backend requested by name cannot run here.
    """
    hidden, weight, bias, low_rank = _apply_autocast(hidden, weight, bias, low_rank)
    _check_tensors(hidden, weight, labels, bias, low_rank)
    # A statistic the Triton kernels lack sends "auto" to the chunked torch backend (`ops/registry.py`).
    needs = frozenset({"log_sum_sq_probs"}) if log_sum_sq_probs else frozenset()
    impl = resolve_backend(backend, hidden.device, hidden.dtype, needs)
    ignore_index = _integer("ignore_index", ignore_index)
    _check_label_range(labels, weight.shape[0], ignore_index)
    labels = labels.long()
    # Rows whose label is ignored (prompt positions, padding) are not computed at all:
    # the backend sees the scored rows only and the results are scattered back.
    scored = labels != ignore_index
    rows = scored.nonzero().squeeze(1)  # one host sync
    if sequence_loss is not None:
        check_sequence_loss(sequence_loss, labels.shape[0], hidden.device)
        if entropy_grad:
            raise ValueError(
                "head_logprobs: sequence_loss and entropy_grad=True cannot be combined: a declared "
                "SequenceLoss is a function of the sequences' log-prob sums alone, and a loss that also "
                "takes the entropy is not; pass sequence_loss=None for the per-token op"
            )
        if log_sum_sq_probs:
            raise ValueError(
                "head_logprobs: sequence_loss and log_sum_sq_probs=True cannot be combined: the loss-aware mode's "
                "block math does not compute the statistic; pass sequence_loss=None for the per-token op"
            )
        if batch_invariant:
            raise ValueError(
                "head_logprobs: sequence_loss and batch_invariant=True cannot be combined: the loss-aware "
                "mode takes blocks of whole groups, whose shapes follow the batch; pass sequence_loss=None"
            )
    any_scored = rows.numel() > 0
    if rows.numel() == labels.shape[0]:
        rows = None  # nothing to skip: the backend sees every row
    else:  # (no scored row at all: the backend sees none, and every output is 0, still connected)
        hidden, labels = hidden.index_select(0, rows), labels.index_select(0, rows)
        if low_rank is not None:
            low_rank = LowRank(low_rank.down.index_select(0, rows), low_rank.up, low_rank.scale)
        if sequence_loss is not None:
            sequence_loss = sequence_loss._replace(segments=sequence_loss.segments.index_select(0, rows))
    n, v = hidden.shape[0], weight.shape[0]
    opts = HeadOptions(
        temperature=_positive("temperature", temperature),
        softcap=None if softcap is None else _positive("softcap", softcap),
        logit_scale=_finite("logit_scale", logit_scale),
        ignore_index=ignore_index,
        low_rank_scale=0.0 if low_rank is None else _finite("low_rank.scale", low_rank.scale),
        entropy=bool(entropy) or bool(entropy_grad),
        entropy_grad=bool(entropy_grad),
        logit_mean=bool(logit_mean),
        argmax=bool(argmax),
        log_sum_sq_probs=bool(log_sum_sq_probs),
        batch_invariant=bool(batch_invariant),
        chunk_rows=resolve_chunk_rows(n, v, hidden.device, chunk_size, memory_budget_bytes, bool(batch_invariant)),
    )
    out = None
    wants_grad = torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in (hidden, weight, bias)
    )
    if sequence_loss is not None and impl.blocks is not None and low_rank is None and wants_grad and any_scored:
        out = loss_aware_head_logprobs(impl.blocks, hidden, weight, labels, bias, sequence_loss, opts,
                                       impl.name, block_budget_bytes)
    if out is None:
        out = impl.run(hidden, weight, labels, bias, low_rank, opts)
    return out if rows is None else _scatter_rows(out, rows, scored.shape[0])


def _scatter_rows(out: HeadOutput, rows: Tensor, n: int) -> HeadOutput:
    """Puts the results of the scored rows back at their positions; 0 / False elsewhere."""

    def put(value: Tensor | None) -> Tensor | None:
        if value is None:
            return None
        return value.new_zeros((n,)).index_copy(0, rows, value)

    return out._replace(logps=put(out.logps), entropy=put(out.entropy), logit_mean=put(out.logit_mean),
                        argmax_match=put(out.argmax_match), log_sum_sq_probs=put(out.log_sum_sq_probs))


def reference_head_logprobs(*args, backend: str = "reference", **kwargs) -> HeadOutput:
    """`head_logprobs(*args, **kwargs)` on the "reference" backend: the unfused oracle.

    A thin wrapper, so that the op's signature lives in one place (`head_logprobs`, whose
    docstring lists every argument). The reference materialises z, allocating several
    [N, V] tensors: for tests and benchmarks, never for training. `chunk_size` and
    `memory_budget_bytes` are validated and then ignored; `sequence_loss` never applies
    (the reference has no block math).

    Raises:
        ValueError: `backend` names anything but "reference" (or "auto").
    """
    if backend not in ("reference", "auto"):
        raise ValueError(
            f"reference_head_logprobs always runs the 'reference' backend; got "
            f"backend={backend!r}. Call head_logprobs(..., backend={backend!r}) instead."
        )
    return head_logprobs(*args, backend="reference", **kwargs)


def _apply_autocast(hidden, weight, bias, low_rank):
    """Cast the inputs as `F.linear` would under an active autocast, then run without it.

    The unfused model computes its logits with `lm_head` under autocast; casting the same
    tensors here (differentiably, outside the autograd function) gives the same GEMM
    dtype, and the backend then keeps its softmax in fp32 whatever autocast says.
    """
    if not isinstance(hidden, Tensor):
        return hidden, weight, bias, low_rank  # _check_tensors reports it
    device_type = hidden.device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias, low_rank
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        # Autocast leaves fp64 alone; so do we.
        ok = isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if ok else t

    if low_rank is not None and isinstance(low_rank, LowRank):
        low_rank = LowRank(cast(low_rank.down), cast(low_rank.up), low_rank.scale)
    return cast(hidden), cast(weight), cast(bias), low_rank


def _check_tensors(hidden, weight, labels, bias, low_rank) -> None:
    """Shapes, dtypes and devices, with messages naming the argument and the expectation."""
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(
            f"hidden must be [N, H] (flatten batch and sequence first); got shape "
            f"{tuple(hidden.shape)}"
        )
    n, h = hidden.shape
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be a floating-point tensor, got {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != h or weight.shape[0] < 1:
        raise ValueError(
            f"weight must be [V, H] = [V, {h}] with V >= 1 (H from hidden [N, H] = "
            f"{list(hidden.shape)}); got shape {tuple(weight.shape)}"
        )
    v = weight.shape[0]
    _same(hidden, "weight", weight)
    if labels.shape != (n,):
        raise ValueError(f"labels must be [N] = [{n}]; got shape {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (torch.long), got {labels.dtype}")
    _same(hidden, "labels", labels, dtype=False)
    if bias is not None:
        if not isinstance(bias, Tensor) or bias.shape != (v,):
            shape = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
            raise ValueError(f"bias must be None or [V] = [{v}]; got {shape}")
        if not bias.is_floating_point():
            raise TypeError(f"bias must be floating-point, got {bias.dtype}")
        _same(hidden, "bias", bias, dtype=False)
    if low_rank is not None:
        _check_low_rank(low_rank, n, v, hidden)


def _check_low_rank(low_rank, n: int, v: int, hidden: Tensor) -> None:
    if not isinstance(low_rank, LowRank):
        raise TypeError(
            f"low_rank must be a fusedalign.ops.LowRank(down, up, scale) or None, got "
            f"{type(low_rank).__name__}"
        )
    down, up = low_rank.down, low_rank.up
    if not isinstance(down, Tensor) or not isinstance(up, Tensor):
        raise TypeError("low_rank.down and low_rank.up must be torch.Tensors")
    if down.dim() != 2 or down.shape[0] != n:
        raise ValueError(f"low_rank.down must be [N, r] = [{n}, r]; got {tuple(down.shape)}")
    r = down.shape[1]
    if up.shape != (v, r):
        raise ValueError(
            f"low_rank.up must be [V, r] = [{v}, {r}] (r from low_rank.down); got "
            f"{tuple(up.shape)}"
        )
    if not down.is_floating_point() or down.dtype != up.dtype:
        raise TypeError(
            f"low_rank.down and low_rank.up must share one floating dtype; got {down.dtype} "
            f"and {up.dtype}"
        )
    _same(hidden, "low_rank.down", down, dtype=False)
    _same(hidden, "low_rank.up", up, dtype=False)


def _same(hidden: Tensor, name: str, t: Tensor, dtype: bool = True) -> None:
    if t.device != hidden.device:
        raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if dtype and t.dtype != hidden.dtype:
        raise TypeError(
            f"{name} has dtype {t.dtype} but hidden has {hidden.dtype}; cast one of them "
            "(or run under torch.autocast)"
        )


def _check_label_range(labels: Tensor, v: int, ignore_index: int) -> None:
    # One small reduction (a device sync on CUDA) buys a clear error instead of an
    # out-of-range gather, which on CUDA is an asynchronous device-side assert.
    scored = labels != ignore_index
    bad = scored & ((labels < 0) | (labels >= v))
    if labels.numel() and bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"labels must be in [0, V) = [0, {v}) or ignore_index={ignore_index}; "
            f"labels[{first}] = {int(labels[first])}"
        )


def _positive(name: str, x) -> float:
    x = _finite(name, x)
    if x <= 0:
        raise ValueError(f"{name} must be > 0, got {x}")
    return x


def _finite(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, Real) or not math.isfinite(float(x)):
        raise ValueError(f"{name} must be a finite real number, got {x!r}")
    return float(x)


def _integer(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, got {x!r}")
    return x
