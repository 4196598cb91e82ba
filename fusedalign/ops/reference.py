"""The "reference" backend: the unfused computation, materialising z [N, V].

It is the definition in docs/internals.md written as plainly as possible and
differentiated by autograd. Tests and benchmarks compare every other backend with it;
training should never use it (it allocates several N x V tensors).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from fusedalign.ops.options import HeadOptions, HeadOutput, LowRank, compute_dtype
from fusedalign.ops.registry import Backend, register_backend


def unfused_head_logprobs(
    hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
    low_rank: LowRank | None, opts: HeadOptions,
) -> HeadOutput:
    """The "reference" backend. Inputs are validated by `head_logprobs`; shapes as there.

    With `batch_invariant` it runs each row as a call of its own (a fresh copy of the row:
    one shape and one alignment whatever the batch), and concatenates the results.
    """
    if opts.batch_invariant and hidden.shape[0] > 1:
        one = replace(opts, batch_invariant=False)
        parts = [
            unfused_head_logprobs(
                hidden[i:i + 1].clone(), weight, labels[i:i + 1], bias,
                None if low_rank is None else low_rank._replace(down=low_rank.down[i:i + 1].clone()), one,
            )
            for i in range(hidden.shape[0])
        ]
        cat = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        return HeadOutput(cat("logps"), cat("entropy"), cat("logit_mean"), cat("argmax_match"), backend="reference",
                          log_sum_sq_probs=cat("log_sum_sq_probs"))
    cdt = compute_dtype(hidden.dtype)
    # The GEMMs run in the input dtype and are upcast afterwards, as in every backend.
    a = (hidden @ weight.t()).to(cdt)  # [N, H] @ [H, V]
    if bias is not None:
        a = a + bias.to(cdt)
    if low_rank is not None:
        a = a + low_rank.scale * (low_rank.down @ low_rank.up.t()).to(cdt)  # [N, r] @ [r, V]
    a = a * opts.logit_scale
    z = a if opts.softcap is None else opts.softcap * torch.tanh(a / opts.softcap)
    y = z / opts.temperature
    logp_all = torch.log_softmax(y, dim=-1)  # [N, V]

    valid = labels != opts.ignore_index
    safe = labels.masked_fill(~valid, 0)
    target = logp_all.gather(1, safe[:, None]).squeeze(1)
    logps = torch.where(valid, target, 0.0).to(cdt)

    entropy = mean = match = sum_sq = None
    if opts.entropy_grad:  # differentiated by autograd; ignored rows keep their value, get no gradient
        entropy = -(logp_all.exp() * logp_all).sum(dim=-1).to(cdt)
        entropy = torch.where(valid, entropy, entropy.detach())
    with torch.no_grad():
        if opts.entropy and not opts.entropy_grad:
            entropy = -(logp_all.exp() * logp_all).sum(dim=-1).to(cdt)
        if opts.logit_mean:
            mean = z.mean(dim=-1).to(cdt)
        if opts.argmax:
            match = (z.argmax(dim=-1) == safe) & valid
        if opts.log_sum_sq_probs:  # log sum_v p_v^2, as the definition writes it
            sum_sq = (torch.logsumexp(2 * y, dim=-1) - 2 * torch.logsumexp(y, dim=-1)).to(cdt)
    return HeadOutput(logps, entropy, mean, match, backend="reference", log_sum_sq_probs=sum_sq)


register_backend(Backend(key="reference", name="reference", run=unfused_head_logprobs,
                         statistics=frozenset({"log_sum_sq_probs"})))
