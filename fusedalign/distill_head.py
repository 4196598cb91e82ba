"""Installs the divergence op inside both heads' own forwards: a student's and a teacher's.

Distillation's loss needs two output heads at once, and each may be sharded by its own
backend wrapper (the student trained under ZeRO-3 or FSDP2, the teacher a frozen copy
partitioned the same way). `fused_head` (head.py) already shows why a head's weight may only
be read inside that head's own forward; here there are two, so the calls nest:

1. The teacher's ordinary `teacher(**batch)` runs with its head's forward replaced by one that
   keeps the final hidden states it receives (and returns a [B, T] placeholder): the backbone
   ran inside the teacher's own forward, every hook fired, no logits were made.
2. The student's ordinary `student(**batch)` runs with its head's forward replaced (through
   head.py's plain and LoRA forwards) by one that *calls the teacher's head module* with the
   teacher's hidden states and its own. That call fires the teacher head's hooks (ZeRO-3
   gathers its weight, and arms the backward hooks that gather it again for the recompute);
   inside it, the teacher head's forward is the fused op (`ops.divergence_head`), with both
   heads' weights in hand, each read inside its own module's call.

The divergence leaves through the teacher head's output, then the student head's, then the
student model's `logits`, so every backend's backward hooks wrap it. Passing the student's
hidden states into the teacher head's call matters: a backend wraps a module's inputs that
need a gradient with the hook that runs after that module's backward (ZeRO-3 re-partitions
the teacher head there). Each model's logit post-processing (`architectures.py`) moves into
the op while the context is active.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch
from torch import nn

from fusedalign.architectures import UnsupportedArchitectureError, post_processing_of
from fusedalign.head_forward import IGNORE_INDEX, _head_module, _lora_forward, _plain_forward, _replaced_forward
from fusedalign.model_calls import _is_lora_layer, forward_inputs, unwrap_model
from fusedalign.ops import LowRank
from fusedalign.ops.divergence_api import divergence_head, generalised_jsd


class TokenDivergence(NamedTuple):
    """Per-token results of one student forward against the teacher, fused or not.

    Attributes:
        divergence: [B, T] float32, D_beta of each scored position (0 where the label is
            ignored); carries the gradient to the student (through its model's output).
        entropy: [B, T] float32, the student's entropy at the temperature, detached; 0 where ignored.
    """

    divergence: torch.Tensor
    entropy: torch.Tensor


class DivergenceHead:
    """State of one `fused_divergence` context: the teacher's captured hidden states, the op's options."""

    def __init__(self, labels: torch.Tensor, beta: float, temperature: float, student_post, teacher_post,
                 teacher_head: nn.Module, op_kwargs: dict):
        self.labels = labels
        self.beta = beta
        self.temperature = temperature
        self.student_post, self.teacher_post = student_post, teacher_post
        self.teacher_head = teacher_head
        self.op_kwargs = op_kwargs
        self.teacher_hidden: torch.Tensor | None = None
        self.student: tuple | None = None  # (weight, bias, low_rank) while the student's head runs
        self.calls = {"teacher": 0, "student": 0}
        self.entropy: torch.Tensor | None = None

    def compute(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                low_rank: LowRank | None) -> torch.Tensor:
        """The student's head forward (head.py calls it with its weights gathered): calls the teacher's head."""
        if self.teacher_hidden is None:
            raise RuntimeError(
                "fused_divergence: the student's head ran before the teacher's forward; call teacher(**batch) "
                "first inside the context"
            )
        self.student = (weight, bias, low_rank)
        try:
            # A module call, so the teacher head's hooks gather its weight (and wrap the output for backward).
            return self.teacher_head(self.teacher_hidden, hidden)
        finally:
            self.student = None

    def teacher_forward(self, head: nn.Linear, hidden: torch.Tensor, student_hidden: torch.Tensor | None = None):
        """The teacher head's forward: captures (teacher's own call) or runs the op (called by the student's head)."""
        if student_hidden is None:
            self.teacher_hidden = hidden.detach()
            self.calls["teacher"] += 1
            return hidden.new_zeros(hidden.shape[:-1])  # [B, T]: a placeholder where the logits would be
        weight, bias, low_rank = self.student
        batch, kept, width = student_hidden.shape
        labels, teacher_hidden = self.labels, hidden
        if labels.shape[0] != batch or labels.shape[1] < kept or teacher_hidden.shape[:2] != labels.shape:
            raise ValueError(
                f"fused_divergence: labels {tuple(labels.shape)}, teacher hidden {tuple(teacher_hidden.shape)} and "
                f"student hidden {tuple(student_hidden.shape)} do not align; run both models on the same positions "
                "with labels [batch, seq_len]"
            )
        labels = labels[:, labels.shape[1] - kept:].to(student_hidden.device)  # `logits_to_keep` on the student
        teacher_hidden = teacher_hidden[:, teacher_hidden.shape[1] - kept:]
        out = divergence_head(
            student_hidden.reshape(-1, width), weight, labels.reshape(-1),
            teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), head.weight, bias, head.bias,
            beta=self.beta, temperature=self.temperature, softcap=self.student_post.softcap,
            teacher_softcap=self.teacher_post.softcap, logit_scale=self.student_post.logit_scale,
            teacher_logit_scale=self.teacher_post.logit_scale, ignore_index=IGNORE_INDEX, low_rank=low_rank,
            **self.op_kwargs,
        )
        self.calls["student"] += 1
        self.entropy = out.entropy.view(batch, kept)
        # A tensor of its own, not a view of the op's output (FSDP2 hooks module outputs: head.py).
        return out.divergence.view(batch, kept).clone()


@contextlib.contextmanager
def fused_divergence(
    student: nn.Module,
    teacher: nn.Module,
    labels: torch.Tensor,
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    **op_kwargs,
) -> Iterator[DivergenceHead]:
    """Makes `teacher(...)` keep its final hidden states and `student(...)` return the divergence.

    Example:
        with fused_divergence(student, teacher, labels, beta=0.5) as head:
            with torch.no_grad():
                teacher(input_ids=ids, attention_mask=mask)
            divergence = student(input_ids=ids, attention_mask=mask).logits   # [B, T] float32
        head.entropy  # [B, T] the student's entropy, detached

    Args:
        student, teacher: transformers causal LMs, possibly wrapped (DDP, DeepSpeed engine, PEFT,
            FSDP2); the same tokenizer (the teacher's head may have more, padded, rows).
        labels: [B, T] position-aligned (`labels[:, t]` is scored at position t), -100 where
            nothing is scored; only which positions are scored matters.
        beta, temperature: as `ops.divergence_head`.
        op_kwargs: chunking options of `ops.divergence_head` (chunk_size, vocab_chunk_size,
            memory_budget_bytes, backend).

    Raises:
        UnsupportedArchitectureError: either model post-processes its logits in a way not registered,
            or the teacher's head is not an nn.Linear.
        RuntimeError: a fused head is already installed on either model.
    """
    if labels.dim() != 2:
        raise ValueError(f"fused_divergence: labels must be [batch, seq_len], got shape {tuple(labels.shape)}.")
    lm_s, lm_t = unwrap_model(student), unwrap_model(teacher)
    post_s, post_t = post_processing_of(lm_s), post_processing_of(lm_t)
    head_s, head_t = _head_module(lm_s), _head_module(lm_t)
    if not _is_lora_layer(head_s) and not isinstance(head_s, nn.Linear):
        raise UnsupportedArchitectureError(
            f"fused_divergence: the student's output embedding is a {type(head_s).__name__}, not an nn.Linear "
            "or a PEFT LoRA layer; use fused=False."
        )
    if not isinstance(head_t, nn.Linear):
        raise UnsupportedArchitectureError(
            f"fused_divergence: the teacher's output embedding is a {type(head_t).__name__}, not an nn.Linear "
            "(merge any adapter into the teacher first); use fused=False."
        )
    state = DivergenceHead(labels, beta, temperature, post_s, post_t, head_t, op_kwargs)
    student_forward = _lora_forward(state) if _is_lora_layer(head_s) else _plain_forward(state)
    with _replaced_forward(head_t, state.teacher_forward), _replaced_forward(head_s, student_forward):
        undo = [post_s.disable(), post_t.disable()]
        try:
            yield state
        finally:
            for step in reversed(undo):
                step()


def token_divergence(
    student: nn.Module,
    teacher: nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    *,
    fused: bool = True,
    beta: float = 1.0,
    temperature: float = 1.0,
    teacher_inputs: dict[str, torch.Tensor] | None = None,
    **op_kwargs,
) -> TokenDivergence:
    """Per-token divergence of the student from the teacher, from one ordinary forward of each.

    With `fused=True` neither model's logits are materialised (`fused_divergence`); with
    `fused=False` both are, and TRL's formula is computed from them (the oracle in every test).

    Args:
        student, teacher: the models as the backend prepared them (call them, never their parts).
        inputs: keyword arguments of the student's forward (input_ids, attention_mask, position_ids).
        labels: [B, T] position-aligned, -100 where nothing is scored.
        teacher_inputs: the teacher's, when they differ (default: `inputs`); same positions.
    """
    teacher_inputs = inputs if teacher_inputs is None else teacher_inputs
    if not fused:
        with torch.no_grad():
            teacher_logits = teacher(**forward_inputs(teacher, teacher_inputs)).logits  # [B, T, Vt]
        student_logits = student(**forward_inputs(student, inputs)).logits  # [B, T, Vs]
        divergence, entropy = generalised_jsd(student_logits, teacher_logits, beta, temperature=temperature)
        ignored = (labels == IGNORE_INDEX).to(divergence.device)
        return TokenDivergence(divergence.masked_fill(ignored, 0.0), entropy.masked_fill(ignored, 0.0))
    with fused_divergence(student, teacher, labels, beta=beta, temperature=temperature, **op_kwargs) as head:
        with torch.no_grad():
            teacher(**forward_inputs(teacher, teacher_inputs))
        out = student(**forward_inputs(student, inputs))
    if head.calls != {"teacher": 1, "student": 1}:
        raise RuntimeError(f"fused_divergence: expected each head to run once in its forward, got {head.calls}")
    # From the model's output, where the backends' backward hooks are (head.py).
    divergence = out.logits
    if divergence.shape != head.entropy.shape:
        raise RuntimeError(
            f"fused_divergence: the student returned {tuple(divergence.shape)} where the head produced "
            f"{tuple(head.entropy.shape)}; the model transforms its head's output in a way this does not understand. "
            "Use fused=False."
        )
    return TokenDivergence(divergence, head.entropy)
