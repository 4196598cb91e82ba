"""Known bug classes, injected for `fusedalign verify --self_test` only.

Each injection is a context manager that monkeypatches the library around one run of
verify's own worker process (`worker.py`), the only caller; nothing in training reads
these names. Each reproduces a failure that trains without an error on some backend:

- `head_by_attribute`: the fused head takes its weight as it was outside the head's own
  call (TRL's fused losses read `lm_head.weight` by attribute): under ZeRO-3 that is an
  empty shard, under FSDP2 a local shard; the gradient still reaches the parameter.
- `per_micro_batch`: each micro-batch's loss is divided by its own count of units instead
  of the count over the whole optimizer step on all ranks, so N ranks train differently
  from one process whenever ranks hold different numbers of tokens.
- `softcap_dropped`: the fused path turns the model's final-logit soft-cap off (as it
  must) but does not apply it in the op (Gemma 2).
- `lora_head_no_grad`: a LoRA adapter on the head gets no gradient in the fused path.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class _ReadOutside(torch.autograd.Function):
    """Forward: the weight's data as read outside the head's call; backward: into the parameter."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        return seen.view_as(seen)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _head_by_attribute() -> contextlib.AbstractContextManager:
    import fusedalign.head as head

    original = head.fused_head

    @contextlib.contextmanager
    def fused_head(model: Any, labels: torch.Tensor, **kwargs: Any) -> Iterator[Any]:
        module = head._head_module(head.unwrap_model(model))
        seen = module.weight.data  # read by attribute, outside the module's call
        compute = head.FusedHead.compute

        def compute_outside(self: Any, hidden: torch.Tensor, weight: torch.Tensor, *rest: Any) -> torch.Tensor:
            return compute(self, hidden, _ReadOutside.apply(weight, seen), *rest)

        with _patched(head.FusedHead, "compute", compute_outside), original(model, labels, **kwargs) as state:
            yield state

    return _patched(head, "fused_head", fused_head)


def _per_micro_batch() -> contextlib.AbstractContextManager:
    from fusedalign.trainers.base import FusedAlignTrainer, is_prepared

    compute_loss = FusedAlignTrainer.compute_loss

    def per_micro_batch(self: Any, model: Any, inputs: Any, return_outputs: bool = False,
                        num_items_in_batch: Any = None) -> Any:
        if num_items_in_batch is not None and is_prepared(inputs):
            local = torch.as_tensor(self.count_items(inputs), device=num_items_in_batch.device).float()
            num_items_in_batch = local * self.accelerator.num_processes
        return compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    return _patched(FusedAlignTrainer, "compute_loss", per_micro_batch)


def _softcap_dropped() -> contextlib.ExitStack:
    import fusedalign.architectures as architectures

    stack = contextlib.ExitStack()
    for model_type, reader in list(architectures.POST_PROCESSING.items()):
        if reader is architectures._final_logit_softcapping:
            dropped = lambda lm, read=reader: dataclasses.replace(read(lm), softcap=None)  # noqa: E731
            stack.enter_context(_patched_item(architectures.POST_PROCESSING, model_type, dropped))
    return stack


@contextlib.contextmanager
def _patched_item(table: dict, key: str, value: Any) -> Iterator[None]:
    old = table[key]
    table[key] = value
    try:
        yield
    finally:
        table[key] = old


def _lora_head_no_grad() -> contextlib.AbstractContextManager:
    import fusedalign.head_forward as head_forward

    low_rank = head_forward.LowRank

    def detached(down: torch.Tensor, up: torch.Tensor, scale: float) -> Any:
        return low_rank(down=down.detach(), up=up.detach(), scale=scale)

    return _patched(head_forward, "LowRank", detached)


INJECTIONS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "head_by_attribute": _head_by_attribute,
    "per_micro_batch": _per_micro_batch,
    "softcap_dropped": _softcap_dropped,
    "lora_head_no_grad": _lora_head_no_grad,
}


def injected(name: str | None) -> contextlib.AbstractContextManager:
    """The named injection, or nothing."""
    return INJECTIONS[name]() if name else contextlib.nullcontext()
