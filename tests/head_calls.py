"""Counts how the loss-aware head ran, from the outside: a test instrument, not a library hook.

    with HeadCalls() as calls:
        trainer.train()
    calls.counts == Counter(forward=2, backward=2)

or, where a `with` block does not fit, `head = HeadCalls().start()` ... `head.stop()`.

While active it wraps three functions of `fusedalign.ops` and counts:

- "forward": loss-aware forwards (`loss_aware_head_logprobs` as `head_logprobs` calls it,
  returning an output);
- "over_budget": calls where a group did not fit the block budget (it returned None, and
  the ordinary op ran);
- "backward": backwards of the loss-aware autograd function, which return the gradients
  formed in the forward;
- "mismatch": end-of-backward checks that raised `DeclaredLossMismatch`.

Everything is restored on exit, so counts never leak between tests.
"""

from __future__ import annotations

from collections import Counter

from fusedalign.ops import api, loss_aware


class HeadCalls:
    """Counts the loss-aware head's paths while active (see the module docstring)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._undo: list[tuple[object, str, object]] = []

    def start(self) -> HeadCalls:
        if self._undo:
            raise RuntimeError("HeadCalls is already counting")
        counts = self.counts
        forward, backward, verify = api.loss_aware_head_logprobs, loss_aware._LossAwareHead.backward, loss_aware._verify_pending

        def counted_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            counts["over_budget" if out is None else "forward"] += 1
            return out

        def counted_backward(ctx, *grads):
            counts["backward"] += 1
            return backward(ctx, *grads)

        def counted_verify():
            try:
                verify()
            except loss_aware.DeclaredLossMismatch:
                counts["mismatch"] += 1
                raise

        self._patch(api, "loss_aware_head_logprobs", counted_forward)
        self._patch(loss_aware._LossAwareHead, "backward", staticmethod(counted_backward))
        self._patch(loss_aware, "_verify_pending", counted_verify)
        return self

    def stop(self) -> Counter:
        """Restores the wrapped functions; returns the counts (a path that never ran reads 0)."""
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()
        return self.counts

    def _patch(self, owner, name: str, value) -> None:
        self._undo.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    def __enter__(self) -> Counter:
        return self.start().counts

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False
