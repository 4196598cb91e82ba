"""Per-token log-probs of a model's next tokens from one ordinary forward, fused or not:
`token_logprobs`, the one entry point every trainer uses.

Fused, the op runs inside the output head's own forward (`fusedalign.head_forward.fused_head`,
the only module that knows how it gets into a model), so every backend's hooks fire as they do
for logits; unfused, the same function is computed from the materialised logits (the oracle).
The names other modules take from here (`unwrap_model`, `forward_inputs`, `IGNORE_INDEX`,
`fused_head`, ...) are re-exported from `head_forward` and `model_calls`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from fusedalign.architectures import (  # noqa: F401  (re-exported: the head's public errors and registry)
    PostProcessing,
    UnsupportedArchitectureError,
    post_processing_of,
    register_architecture,
)
from fusedalign.head_forward import (  # noqa: F401  (re-exported)
    IGNORE_INDEX,
    FusedHead,
    RowLoss,
    _head_module,
    _lora_forward,
    _plain_forward,
    _replaced_forward,
    fused_head,
)
from fusedalign.model_calls import (  # noqa: F401  (re-exported)
    FLEX_KERNEL_OPTIONS,
    _is_lora_layer,
    flex_kernel_options,
    forward_inputs,
    unwrap_model,
)
from fusedalign.ops import LowRank, head_logprobs  # noqa: F401  (re-exported)


class TokenLogProbs(NamedTuple):
    """Per-token results of one forward, fused or not.

    Attributes:
        logps: [B, T] float32 log-prob of each label, 0 where the label is ignored.
            Carries the gradient (through every hook the backend attached).
        entropy: [B, T] float32 entropy of the predictive distribution, or None; detached
            unless asked for with `entropy_grad`, then carrying its gradient (through the
            model's output, as `logps` does). 0 where the label is ignored (those positions
            are not computed).
        logit_mean: [B, T] float32 mean over the vocabulary of the logits, detached, or None;
            0 where the label is ignored.
        argmax_match: [B, T] bool, whether the most likely token is the label, or None.
        backend: what computed them: "unfused" (materialised logits) or the head op's
            backend ("torch-chunked", "triton", "reference").
        log_sum_sq_probs: [B, T] float32 log sum_v p_v^2 of the predictive distribution,
            detached, or None; 0 where the label is ignored.
    """

    logps: torch.Tensor
    entropy: torch.Tensor | None = None
    logit_mean: torch.Tensor | None = None
    argmax_match: torch.Tensor | None = None
    backend: str = "unfused"
    log_sum_sq_probs: torch.Tensor | None = None


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    logit_mean: bool = False,
    argmax: bool = False,
    entropy_grad: bool = False,
    log_sum_sq_probs: bool = False,
) -> TokenLogProbs:
    """The unfused computation: log_softmax over materialised logits, then gather.

    Args:
        logits: [B, T, V] the model's logits (after its own post-processing).
        labels: [B, T] position-aligned labels, -100 where ignored.
        entropy_grad: the entropy keeps its gradient (implies `entropy`).
    """
    z = logits if logits.dtype == torch.float64 else logits.float()  # [B, T, V]
    logprobs = torch.log_softmax(z / temperature, dim=-1)  # [B, T, V]
    ignored = labels == IGNORE_INDEX
    safe = labels.masked_fill(ignored, 0)
    logps = logprobs.gather(-1, safe.unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0.0)  # [B, T]
    ent = (-(logprobs.exp() * logprobs).sum(-1)).masked_fill(ignored, 0.0) if entropy_grad else None
    with torch.no_grad():
        # Statistics of scored positions only, 0 elsewhere, as the fused op gives them.
        if entropy and not entropy_grad:
            ent = (-(logprobs.exp() * logprobs).sum(-1)).masked_fill(ignored, 0.0)
        mean = z.mean(-1).masked_fill(ignored, 0.0) if logit_mean else None
        match = (z.argmax(-1) == labels) & ~ignored if argmax else None
        # log sum_v p_v^2 = logsumexp(2 log p): from the log-probs already here, no other [B, T, V].
        sum_sq = torch.logsumexp(2 * logprobs, -1).masked_fill(ignored, 0.0) if log_sum_sq_probs else None
    return TokenLogProbs(logps, ent, mean, match, log_sum_sq_probs=sum_sq)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' labels ([B, T], aligned with input_ids) as the targets of each position.

    `targets[:, t] = labels[:, t + 1]`: position t predicts the next token; the last position
    predicts nothing (-100). The shift a causal LM's own loss makes, done once here.
    """
    ignored = torch.full_like(labels[:, :1], IGNORE_INDEX)  # [B, 1]
    return torch.cat([labels[:, 1:], ignored], dim=1)  # [B, T]


def token_logprobs(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    *,
    labels: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
    fused: bool = True,
    temperature: float = 1.0,
    entropy: bool = False,
    logit_mean: bool = False,
    argmax: bool = False,
    row_loss: RowLoss | None = None,
    entropy_grad: bool = False,
    batch_invariant: bool = False,
    log_sum_sq_probs: bool = False,
) -> TokenLogProbs:
    """Per-token log-probs of the next tokens from one ordinary forward of `model`.

    With `fused=True` the logits are never materialised; with `fused=False` they are,
    and the same function is computed from them (the oracle in every test). Give exactly
    one of `labels` (transformers' convention) or `targets` (already shifted):

        token_logprobs(model, {"input_ids": ids}, labels=ids).logps[:, t]
            == log p(ids[:, t + 1] | ids[:, :t + 1])      # and 0 at the last position
        token_logprobs(model, {"input_ids": ids}, targets=t).logps[:, t]
            == log p(t[:, t] | ids[:, :t + 1])

    Args:
        model: The model as the backend prepared it (call it, never its parts).
        inputs: Keyword arguments of the forward (input_ids, attention_mask, position_ids).
        labels: [B, T] transformers' labels, aligned with input_ids (`labels=input_ids`
            scores every next token), -100 where ignored; shifted here, as a causal LM's
            loss does. The result's position t scores `labels[:, t + 1]`.
        targets: [B, T] the token each position predicts (`targets[:, t]` is scored at
            position t), -100 where ignored: what the trainers build.
        row_loss: The loss the log-probs feed, per row sum (fused only: lets the head form its
            gradient in the forward; the unfused path computes the same function without it).
        entropy_grad: Return the entropy with its gradient (GRPO's entropy bonus), fused or not.
        log_sum_sq_probs: Also return log sum_v p_v^2 per position, detached (WPO's weights); fused, the
            head op's chunked torch backend computes it (the Triton kernels do not).
        batch_invariant: Fused only: the head's results for a row do not depend on the batch's
            other rows (`ops.head_logprobs`); the unfused path computes the same function from
            the model's logits without it.
    """
    if (labels is None) == (targets is None):
        raise TypeError("token_logprobs: give exactly one of labels= (aligned with input_ids, as in "
                        "transformers) or targets= (targets[:, t] is predicted at position t).")
    labels = shift_labels(labels) if targets is None else targets
    stats = {"entropy": entropy, "logit_mean": logit_mean, "argmax": argmax, "entropy_grad": entropy_grad,
             "log_sum_sq_probs": log_sum_sq_probs}
    if not fused:
        logits = model(**forward_inputs(model, inputs)).logits
        return logprobs_from_logits(logits, labels, temperature=temperature, **stats)
    with fused_head(model, labels, temperature=temperature, row_loss=row_loss, batch_invariant=batch_invariant,
                    **stats) as head:
        out = model(**forward_inputs(model, inputs))
    if head.calls != 1:
        raise RuntimeError(
            f"fused_head: the output head ran {head.calls} times in one forward; expected exactly once."
        )
    # Take the log-probs from the model's output, not from inside the head: backends
    # (ZeRO-3) attach their backward hooks to module outputs, so the gradient must
    # flow through what the model returned.
    logps = out.logits
    produced = head.last.logps.shape + ((2,) if entropy_grad else ())
    if logps.shape != produced:
        raise RuntimeError(
            f"fused_head: the model returned {tuple(logps.shape)} where the head produced "
            f"{tuple(produced)}; the model transforms the head's output in a way fused_head "
            "does not understand. Use fused_head=False."
        )
    last = head.last
    entropy_out = last.entropy
    if entropy_grad:  # the entropy's gradient, too, flows through the model's output
        logps, entropy_out = logps.unbind(-1)
    return TokenLogProbs(logps, entropy_out, last.logit_mean, last.argmax_match, last.backend, last.log_sum_sq_probs)
