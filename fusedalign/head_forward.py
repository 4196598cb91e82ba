"""Installs the log-prob op inside the model's output-embedding forward (`fused_head`).

This is the only module that knows how `fusedalign.ops.head_logprobs` gets into a
model. `fused_head(model, labels)` replaces the forward of the module that
`get_output_embeddings()` returns, for the duration of a `with` block, so that the
model's ordinary forward — called through whatever wrapper a backend put around it
(DDP, a DeepSpeed engine, an FSDP2 module) — returns per-token log-probs `[B, T]`
where it would have returned logits `[B, T, V]`.

Why inside the head's own forward: every backend attaches its machinery to module
calls. ZeRO-3 gathers a module's parameters in a pre-forward hook, re-partitions them
after, and arms its gradient reduction through hooks on the module's outputs; FSDP2
unshards the root's parameters for the root forward; DDP's reducer watches the
parameters' gradients. Reading `lm_head.weight` by attribute outside that call sees an
empty ZeRO-3 shard or a stale FSDP2 shard. Inside the call, every hook has fired.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn

from fusedalign.architectures import PostProcessing, UnsupportedArchitectureError, post_processing_of
from fusedalign.model_calls import _is_lora_layer, unwrap_model
from fusedalign.ops import LowRank, SequenceLoss, head_logprobs

IGNORE_INDEX = -100


class RowLoss(NamedTuple):
    """The loss fed by a batch's log-probs, as a function of each row's sum of log-probs.

    Declaring it lets the head form its gradient in the forward (`ops.SequenceLoss`, the
    loss-aware mode: one logits GEMM fewer); it is checked against the real gradient in
    backward. Only for losses whose gradient for a row depends on the sums of its group.

    Attributes:
        groups: [B] long, the group of each batch row (a DPO pair: its chosen and rejected rows);
            with `segments`, [S]: the group of each sequence.
        grad: row sums [B] (or sequence sums [S]) -> their gradient; see `ops.SequenceLoss.grad`.
        segments: [B, T] long, the sequence each position's log-prob is summed into (any value
            where the label is ignored), for rows that hold several sequences (padding-free and
            shared-prompt preference rows); None: each row is one sequence.
    """

    groups: torch.Tensor
    grad: Callable[[torch.Tensor], torch.Tensor]
    segments: torch.Tensor | None = None


class FusedHead:
    """State of one `fused_head` context: the op's options and the last statistics."""

    def __init__(self, labels: torch.Tensor, post: PostProcessing, temperature: float, stats: dict[str, bool],
                 row_loss: RowLoss | None = None):
        self.labels = labels
        self.post = post
        self.temperature = temperature
        self.stats_requested = stats
        self.row_loss = row_loss
        self.calls = 0
        self.last = None  # HeadOutput of the last head call, reshaped to [B, T]

    def compute(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, low_rank: LowRank | None
    ) -> torch.Tensor:
        """Runs the op for hidden `[B, T', H]`; returns log-probs `[B, T']`, or `[B, T', 2]`
        (log-probs, entropy) stacked when the entropy's gradient was asked for."""
        batch, kept, width = hidden.shape
        labels = self.labels
        if labels.shape[0] != batch or labels.shape[1] < kept:
            raise ValueError(
                f"fused_head: labels have shape {tuple(labels.shape)} but the head received hidden states "
                f"of shape {tuple(hidden.shape)}; labels must be [batch, seq_len] aligned to the input positions."
            )
        # `logits_to_keep` slices the last positions before the head; score the same ones.
        labels = labels[:, labels.shape[1] - kept :].to(hidden.device)
        sequence_loss = None
        if self.row_loss is not None:
            if self.row_loss.segments is None:
                rows = torch.arange(batch, device=hidden.device).repeat_interleave(kept)  # [B*T']: row of each position
            else:  # [B*T']: sequence of each position
                rows = self.row_loss.segments[:, -kept:].reshape(-1).to(hidden.device)
            sequence_loss = SequenceLoss(rows, self.row_loss.groups.to(hidden.device), self.row_loss.grad)
        out = head_logprobs(
            hidden.reshape(-1, width),  # [B*T', H]
            weight,  # [V, H]
            labels.reshape(-1),  # [B*T']
            bias,
            temperature=self.temperature,
            softcap=self.post.softcap,
            logit_scale=self.post.logit_scale,
            ignore_index=IGNORE_INDEX,
            low_rank=low_rank,
            sequence_loss=sequence_loss,
            **self.stats_requested,
        )
        self.calls += 1
        self.last = out._replace(
            **{
                name: (value.view(batch, kept) if torch.is_tensor(value) else value)
                for name, value in out._asdict().items()
            }
        )
        if self.stats_requested.get("entropy_grad"):
            # Both outputs leave through the module's return value, where ZeRO-3 arms its hooks
            # (a new tensor, not a view: see below).
            return torch.stack([self.last.logps, self.last.entropy], dim=-1)  # [B, T', 2]
        # A tensor of its own, not a view of the op's [N] output: FSDP2 registers its pre-backward
        # hook on a module's output and warns that an in-place op on a returned view would drop it.
        return self.last.logps.clone()


def _plain_forward(state: FusedHead) -> Callable:
    def forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        # Runs inside the module call: every backend's pre-forward hook has fired, so
        # `self.weight` is the full, current weight (gathered / unsharded).
        return state.compute(hidden, self.weight, self.bias, None)

    return forward


def _lora_forward(state: FusedHead) -> Callable:
    """Forward for a PEFT LoRA layer on the head: W x + b + Σ scale·B(A(dropout(x))).

    The A projections are ordinary module calls. The base weight and the B weights are
    read inside their own modules' calls, nested, so that every one of them is gathered
    at once when the op runs — and each module's backward hooks wrap the output.
    """

    def forward(self: nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        base = self.get_base_layer()
        if self.disable_adapters or self.merged:
            adapters = []
        else:
            adapters = [a for a in self.active_adapters if a in self.lora_A]
        for name in adapters:
            if getattr(self, "use_dora", {}).get(name, False) or self.lora_B[name].bias is not None:
                raise NotImplementedError(
                    f"fused_head supports plain LoRA on the output head; adapter {name!r} uses DoRA or a "
                    "LoRA bias. Use fused_head=False, or drop LoRA from lm_head (--lora_target_modules)."
                )
        downs = [
            self.lora_A[name](self.lora_dropout[name](hidden.to(self.lora_A[name].weight.dtype))) * self.scaling[name]
            for name in adapters
        ]
        up_modules = [self.lora_B[name] for name in adapters]
        ups: list[torch.Tensor] = []

        def innermost(x: torch.Tensor) -> torch.Tensor:
            low_rank = None
            if ups:
                down = torch.cat(downs, dim=-1).reshape(-1, sum(d.shape[-1] for d in downs))  # [N, Σr]
                up = torch.cat(ups, dim=-1)  # [V, Σr]
                low_rank = LowRank(down=down.to(x.dtype), up=up.to(x.dtype), scale=1.0)
            return state.compute(x, base.weight, base.bias, low_rank)

        return _nested_calls([base, *up_modules], ups, innermost)(hidden)

    return forward


def _nested_calls(modules: list[nn.Module], weights: list[torch.Tensor], innermost: Callable) -> Callable:
    """Calls modules[0](x), inside whose forward modules[1](x) is called, ..., then innermost(x).

    Each module after the first records its `weight` (gathered, inside its own call)
    into `weights` before descending.
    """

    def call(index: int, x: torch.Tensor) -> torch.Tensor:
        if index == len(modules):
            return innermost(x)
        module = modules[index]

        def forward(self: nn.Module, inner_x: torch.Tensor) -> torch.Tensor:
            if index > 0:
                weights.append(self.weight)
            return call(index + 1, inner_x)

        with _replaced_forward(module, forward):
            return module(x)

    return lambda x: call(0, x)


@contextlib.contextmanager
def _replaced_forward(module: nn.Module, forward: Callable) -> Iterator[None]:
    if "forward" in module.__dict__:
        raise RuntimeError(
            f"fused_head: the forward of {type(module).__name__} is already replaced; "
            "fused_head contexts cannot be nested on the same model."
        )
    module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        del module.forward


def _head_module(lm: nn.Module) -> nn.Module:
    head = lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(lm).__name__} has no output embeddings (get_output_embeddings() is None).")
    # PEFT `modules_to_save` keeps a trainable copy of the head beside the original.
    if hasattr(head, "modules_to_save") and hasattr(head, "original_module"):
        active = getattr(head, "active_adapters", None) or [getattr(head, "active_adapter", None)]
        if not head.disable_adapters and active and active[0] in head.modules_to_save:
            head = head.modules_to_save[active[0]]
        else:
            head = head.original_module
    return head


@contextlib.contextmanager
def fused_head(
    model: nn.Module,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    logit_mean: bool = False,
    argmax: bool = False,
    log_sum_sq_probs: bool = False,
    row_loss: RowLoss | None = None,
    entropy_grad: bool = False,
    batch_invariant: bool = False,
) -> Iterator[FusedHead]:
    """Makes `model(...)` return per-token log-probs of `labels` instead of logits.

    Example:
        with fused_head(model, labels) as head:
            logps = model(input_ids=ids, attention_mask=mask).logits   # [B, T] float32
        head.last.entropy  # if requested

    Args:
        model: A transformers causal LM, possibly wrapped (DDP, DeepSpeed engine, PEFT, FSDP2).
        labels: [B, T] token ids aligned to positions (`labels[:, t]` is predicted at position t),
            -100 where nothing is scored.
        temperature: Divides the logits inside the softmax.
        entropy, logit_mean, argmax, log_sum_sq_probs: Which detached per-token statistics to compute in
            the same pass (`ops.head_logprobs`).
        entropy_grad: The entropy with its gradient; the model then returns `[B, T, 2]`
            (log-probs, entropy) stacked where it would return logits.
        batch_invariant: The op's `batch_invariant` (each row's results independent of the
            other rows the head sees; the backbone's own GEMMs are not made invariant).
        row_loss: The loss the log-probs feed, as a function of each row's sum (`RowLoss`), so that
            the head forms its gradient in the forward; None for the ordinary per-token op.

    Raises:
        UnsupportedArchitectureError: The model post-processes logits in a way not registered.
        RuntimeError: A fused_head context is already active on this model.
    """
    if labels.dim() != 2:
        raise ValueError(f"fused_head: labels must be [batch, seq_len], got shape {tuple(labels.shape)}.")
    lm = unwrap_model(model)
    post = post_processing_of(lm)
    stats = {"entropy": entropy, "logit_mean": logit_mean, "argmax": argmax, "entropy_grad": entropy_grad,
             "log_sum_sq_probs": log_sum_sq_probs, "batch_invariant": batch_invariant}
    state = FusedHead(labels, post, temperature, stats, row_loss)
    head = _head_module(lm)
    forward = _lora_forward(state) if _is_lora_layer(head) else _plain_forward(state)
    if not _is_lora_layer(head) and not isinstance(head, nn.Linear):
        raise UnsupportedArchitectureError(
            f"fused_head: the output embedding of {type(lm).__name__} is a {type(head).__name__}, "
            "not an nn.Linear or a PEFT LoRA layer; use fused_head=False."
        )
    with _replaced_forward(head, forward):
        undo = post.disable()
        try:
            yield state
        finally:
            undo()
