"""Completions of realistic lengths from a random model: the end-of-sequence token made likelier
with each token drawn, so that every sampler (transformers' generate, ours) sees lengths from one
stated distribution.

A random model almost never draws its EOS id, so every completion runs to the maximum length,
which no real rollout does. `end_at_lengths(model, fit, eos, max_new_tokens)` puts a forward hook
on the causal LM that, while it decodes (a forward given a KV cache: a generate call's, or
StaticDecode's; training and scoring forwards are left alone), sets the EOS logit of the k-th
completion token (k = 0 at the prefill) to

    logsumexp(the other logits) + logit(h_k),

so that the softmax gives EOS probability h_k exactly (at temperature 1, no top-k/top-p: the
benchmarks' sampling) and the other tokens keep their relative odds. h_k is the hazard of the
length distribution, P(L = k + 1 | L > k), for L a completion length in tokens (EOS included)
with ln L ~ Normal(mu, sigma) fitted by median and 95th percentile (`lengths.LengthFit`),
discretised at half-integers; a completion that reaches max_new_tokens is truncated, as in a
real run. Each row ends independently of the others (the hazard depends on k alone, which all
rows of a batch share: they advance in lockstep), so the lengths follow the distribution
whatever the batch size, and a loop that sets finished rows aside (StaticDecode's compaction)
changes nothing. k is kept in a device tensor that the hook advances in place, so a decoding
step captured as a CUDA graph advances it on every replay.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.builders.lengths import LengthFit


def parse_fit(text: str) -> LengthFit | None:
    """`fixed` (None) or `lognormal:MEDIAN:P95` (tokens)."""
    if text == "fixed":
        return None
    parts = text.split(":")
    if len(parts) != 3 or parts[0] != "lognormal":
        raise ValueError(f"completion lengths: expected fixed or lognormal:MEDIAN:P95, got {text!r}")
    median, p95 = float(parts[1]), float(parts[2])
    if not 1 <= median < p95:
        raise ValueError(f"completion lengths: need 1 <= MEDIAN < P95, got {text!r}")
    return LengthFit(median, p95)


def survival(fit: LengthFit, k: int) -> float:
    """P(L > k) for the discretised log-normal (L >= 1)."""
    if k < 1:
        return 1.0
    return 0.5 * math.erfc((math.log(k + 0.5) - fit.mu) / (fit.sigma * math.sqrt(2)))


def hazards(fit: LengthFit, max_new_tokens: int) -> list[float]:
    """h_k = P(L = k + 1 | L > k) for k < max_new_tokens, kept in (1e-9, 1 - 1e-9)."""
    out = []
    for k in range(max_new_tokens):
        alive, after = survival(fit, k), survival(fit, k + 1)
        h = (alive - after) / alive if alive > 0 else 1.0
        out.append(min(max(h, 1e-9), 1 - 1e-9))
    return out


def expected_live_rows(fit: LengthFit | None, rows: int, max_new_tokens: int) -> list[float]:
    """Rows still decoding at each completion position k (all of them with fixed lengths)."""
    if fit is None:
        return [float(rows)] * max_new_tokens
    return [rows * min(1.0, survival(fit, k) / survival(fit, 0)) for k in range(max_new_tokens)]


def expected_length(fit: LengthFit | None, max_new_tokens: int) -> float:
    return sum(expected_live_rows(fit, 1, max_new_tokens))


def decoding(kwargs: dict) -> bool:
    """Whether a causal LM's forward, called with `kwargs`, is a decoding step: given a KV cache
    (`past_key_values`, or `cache` from transformers 5.2x), as generate's and StaticDecode's are."""
    return any(kwargs.get(name) is not None for name in ("past_key_values", "cache"))


def end_at_lengths(model: Any, fit: LengthFit, eos: int, max_new_tokens: int) -> Any:
    """Installs the hook on `model` (a causal LM); returns its handle (`.remove()` takes it off)."""
    import torch

    device = next(model.parameters()).device
    logit_h = torch.tensor([math.log(h / (1 - h)) for h in hazards(fit, max_new_tokens)], device=device)
    # [1], not a 0-dim tensor: indexing with a 0-dim integer tensor reads it back to the host (a sync,
    # which a CUDA graph's capture refuses); a 1-element index tensor is a gather on the device.
    k = torch.zeros(1, dtype=torch.long, device=device)
    eos_index = torch.tensor([eos], device=device)  # made here: a step captured as a CUDA graph copies nothing from the host

    def hook(module, args, kwargs, output):
        if not decoding(kwargs):
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > 1:
            k.zero_()  # the prefill draws completion token 0
        else:
            k.add_(1)
        z = output.logits[:, -1]
        others = z.float().index_fill(-1, eos_index, float("-inf")).logsumexp(-1)
        z[:, eos] = (others + logit_h[k.clamp(max=max_new_tokens - 1)]).to(z.dtype)  # [B] + [1]
        return None

    return model.register_forward_hook(hook, with_kwargs=True)
