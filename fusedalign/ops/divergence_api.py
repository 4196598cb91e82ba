"""`divergence_head`: validation, autocast, scored rows, and the unfused reference of the divergence op.

The math and the chunked backend are in `ops/divergence.py`; this module pins the call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from fusedalign.ops.api import _apply_autocast, _check_tensors, _finite, _positive
from fusedalign.ops.divergence import DivergenceOptions, DivergenceOutput, HeadSpec, chunked_divergence
from fusedalign.ops.options import LowRank, compute_dtype, resolve_chunk_rows


def generalised_jsd(student_logits: Tensor, teacher_logits: Tensor, beta: float, *,
                    temperature: float = 1.0, teacher_temperature: float | None = None) -> tuple[Tensor, Tensor]:
    """The unfused per-token divergence and student entropy from full logits (TRL 1.16's formula).

    Args:
        student_logits: [..., Vs] the student's logits after its own post-processing.
        teacher_logits: [..., Vt] the teacher's, Vt >= Vs; columns beyond Vs are -inf for the student.
        beta: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), else the
            generalised JSD beta KL(q || m) + (1 - beta) KL(p || m), m = (1 - beta) p + beta q.
        temperature: divides the student's logits (and the teacher's unless `teacher_temperature`).

    Returns:
        (divergence [...], student entropy [...] detached), in float32 (float64 for float64 logits).
    """
    cdt = compute_dtype(student_logits.dtype)
    ys = student_logits.to(cdt) / temperature
    yt = teacher_logits.to(cdt).detach() / (temperature if teacher_temperature is None else teacher_temperature)
    extra = yt.shape[-1] - ys.shape[-1]
    if extra > 0:
        ys = F.pad(ys, (0, extra), value=-math.inf)
    s, t = F.log_softmax(ys, -1), F.log_softmax(yt, -1)
    p, q = s.exp(), t.exp()
    live = p > 0
    # Where p = 0 (the student's columns beyond its vocabulary), p log(p / x) is 0; torch.where keeps
    # the -inf out of the gradient too.
    safe_s = torch.where(live, s, 0.0)
    if beta == 0.0:
        d = (q * (t - s)).sum(-1)
    elif beta == 1.0:
        d = torch.where(live, p * (safe_s - t), 0.0).sum(-1)
    else:
        log_m = torch.logsumexp(torch.stack([s + math.log1p(-beta), t + math.log(beta)]), dim=0)
        d = beta * (q * (t - log_m)).sum(-1) + (1 - beta) * torch.where(live, p * (safe_s - log_m), 0.0).sum(-1)
    entropy = -torch.where(live, p * safe_s, 0.0).sum(-1)
    return d, entropy.detach()


def divergence_head(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    teacher_temperature: float | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    ignore_index: int = -100,
    low_rank: LowRank | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    memory_budget_bytes: int | None = None,
    backend: str = "torch",
) -> DivergenceOutput:
    """Per-token generalised JSD between the student's and the teacher's heads, without N x V logits.

    For every scored token i (the definitions and gradients are in `ops/divergence.py`):

        z_s = student post-processing of (hidden W^T + bias + s down up^T),   z_t likewise for the teacher
        divergence[i] = D_beta(softmax(z_s[i] / temperature), softmax(z_t[i] / teacher_temperature))

    chunked over tokens (`chunk_size`, or rows from `memory_budget_bytes`) and over the
    vocabulary (`vocab_chunk_size`; default: the whole vocabulary, one forward pass).
    Differentiable in hidden, weight, bias, low_rank.down and low_rank.up; the teacher's tensors
    get no gradient.

    Args:
        hidden: [N, H] the student's final hidden states.
        weight: [Vs, H] the student's output embedding, dtype of hidden.
        labels: [N] integer; only `labels != ignore_index` matters (which tokens are scored:
            the others give exactly 0, no gradient, and are not computed).
        teacher_hidden: [N, Ht] the teacher's final hidden states (any floating dtype).
        teacher_weight: [Vt, Ht] the teacher's output embedding, dtype of teacher_hidden, Vt >= Vs.
        bias, teacher_bias: [Vs] / [Vt] or None.
        beta: in [0, 1]: 0 forward KL, 1 reverse KL (TRL's default), else the generalised JSD.
        temperature, teacher_temperature: > 0; the teacher's defaults to the student's.
        softcap, teacher_softcap, logit_scale, teacher_logit_scale: each model's post-processing.
        low_rank: a LoRA adapter on the student's head (`ops.LowRank`), or None.
        chunk_size: tokens per chunk (overrides the budget).
        vocab_chunk_size: vocabulary columns per block; fewer than Vt makes the forward two passes.
        memory_budget_bytes: bytes of one fp32 [rows, columns] block (defaults as `head_logprobs`); peak
            working memory is several such blocks (both models' logits, log-probs and probabilities, the
            mixture's log: about eight), never a tensor of N x V.
        backend: "torch" (chunked) or "reference" (unfused: full logits, autograd).

    Returns:
        DivergenceOutput(divergence [N], student entropy [N] detached, backend).

    Raises:
        ValueError: a shape or value is wrong, or the vocabularies cannot be compared (the message
            says why); TypeError: a dtype is wrong.
    """
    teacher_temperature = temperature if teacher_temperature is None else teacher_temperature
    hidden, weight, bias, low_rank = _apply_autocast(hidden, weight, bias, low_rank)
    teacher_hidden, teacher_weight, teacher_bias, _ = _apply_autocast(teacher_hidden, teacher_weight, teacher_bias,
                                                                      None)
    _check_tensors(hidden, weight, labels.new_zeros(labels.shape), bias, low_rank)
    if not isinstance(teacher_hidden, Tensor) or teacher_hidden.dim() != 2 or teacher_hidden.shape[0] != hidden.shape[0]:
        shape = tuple(teacher_hidden.shape) if isinstance(teacher_hidden, Tensor) else type(teacher_hidden).__name__
        raise ValueError(f"teacher_hidden must be [N, Ht] with the student's N = {hidden.shape[0]} tokens; got {shape}")
    _check_tensors(teacher_hidden, teacher_weight, labels.new_zeros(labels.shape), teacher_bias, None)
    beta = _finite("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {beta}")
    vs, vt = weight.shape[0], teacher_weight.shape[0]
    if vt < vs:
        raise ValueError(
            f"the teacher's vocabulary ({vt}) is smaller than the student's ({vs}): the student's extra tokens "
            "have no teacher probability, so the divergence is undefined; use a teacher with the student's tokenizer"
        )
    if vt > vs and beta == 0.0:
        raise ValueError(
            f"the teacher's vocabulary ({vt}) is larger than the student's ({vs}) and beta=0 (forward KL): "
            "the teacher's mass on the extra tokens, which the student can never produce, makes KL(teacher || student) infinite; "
            "use beta > 0, or a teacher whose head has the student's vocabulary"
        )
    if backend not in ("torch", "reference"):
        raise ValueError(f"backend must be 'torch' or 'reference', got {backend!r}")
    scored = labels != ignore_index
    rows = scored.nonzero().squeeze(1)
    if rows.numel() < labels.shape[0]:
        hidden, teacher_hidden = hidden.index_select(0, rows), teacher_hidden.index_select(0, rows)
        if low_rank is not None:
            low_rank = low_rank._replace(down=low_rank.down.index_select(0, rows))
    else:
        rows = None
    student = HeadSpec(_positive("temperature", temperature),
                       None if softcap is None else _positive("softcap", softcap), _finite("logit_scale", logit_scale))
    teacher = HeadSpec(_positive("teacher_temperature", teacher_temperature),
                       None if teacher_softcap is None else _positive("teacher_softcap", teacher_softcap),
                       _finite("teacher_logit_scale", teacher_logit_scale))
    if backend == "reference":
        out = _reference(hidden, weight, bias, low_rank, teacher_hidden, teacher_weight, teacher_bias, beta,
                         student, teacher)
    else:
        cols = vt if vocab_chunk_size is None else min(vt, _chunk("vocab_chunk_size", vocab_chunk_size))
        opts = DivergenceOptions(
            beta=beta, student=student, teacher=teacher,
            low_rank_scale=0.0 if low_rank is None else _finite("low_rank.scale", low_rank.scale),
            chunk_rows=resolve_chunk_rows(hidden.shape[0], cols, hidden.device, chunk_size, memory_budget_bytes),
            chunk_cols=cols,
        )
        down, up = (None, None) if low_rank is None else (low_rank.down, low_rank.up)
        out = chunked_divergence(hidden, weight, bias, down, up, teacher_hidden, teacher_weight, teacher_bias, opts)
    if rows is None:
        return out
    put = lambda x: x.new_zeros(labels.shape).index_copy(0, rows, x)  # noqa: E731
    return out._replace(divergence=put(out.divergence), entropy=put(out.entropy))


def _chunk(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return x


def _post(a: Tensor, spec: HeadSpec) -> Tensor:
    a = a * spec.logit_scale
    return a if spec.softcap is None else spec.softcap * torch.tanh(a / spec.softcap)


def _reference(hidden, weight, bias, low_rank, teacher_hidden, teacher_weight, teacher_bias, beta,
               student: HeadSpec, teacher: HeadSpec) -> DivergenceOutput:
    """The definition on full logits, differentiated by autograd (tests only: several N x V tensors)."""
    cdt = compute_dtype(hidden.dtype)
    a = (hidden @ weight.t()).to(cdt)
    if bias is not None:
        a = a + bias.to(cdt)
    if low_rank is not None:
        a = a + low_rank.scale * (low_rank.down @ low_rank.up.t()).to(cdt)
    with torch.no_grad():
        at = (teacher_hidden @ teacher_weight.t()).to(cdt)
        if teacher_bias is not None:
            at = at + teacher_bias.to(cdt)
    d, entropy = generalised_jsd(_post(a, student), _post(at, teacher), beta, temperature=student.temperature,
                                 teacher_temperature=teacher.temperature)
    return DivergenceOutput(d, entropy, "reference")
