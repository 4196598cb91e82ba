"""The loss-aware mode of `head_logprobs` (`ops/loss_aware.py`), on the torch backend.

The oracle is the ordinary op's result pushed through the same loss by autograd (and,
through it, the unfused logits oracle of test_ops.py): the loss-aware op must give the
same values and every gradient, whatever the caller scales the loss by; raise at the end
of the backward when the loss is not the declared one; and keep its memory to a block of
whole groups, never N x V.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from fusedalign.ops import BlockForward, BlockMath, DeclaredLossMismatch, LowRank, SequenceLoss, head_logprobs
from tests.head_calls import HeadCalls
from tests.unit.test_ops import NumelRecorder, fro_err, make_problem, rel_err


def dpo_like(sums: torch.Tensor, ref: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """A sigmoid DPO loss over pairs (s, s + P) of sequence sums [2P]."""
    half = sums.shape[0] // 2
    margin = (sums[:half] - ref[:half]) - (sums[half:] - ref[half:])
    return -F.logsigmoid(beta * margin).sum()


def declared(segments: torch.Tensor, ref: torch.Tensor, loss=dpo_like) -> SequenceLoss:
    half = ref.shape[0] // 2

    def grad(sums):
        sums = sums.detach().requires_grad_()
        return torch.autograd.grad(loss(sums, ref.to(sums.dtype)), sums)[0]

    pair = torch.arange(half, device=segments.device)
    return SequenceLoss(segments, torch.cat([pair, pair]), grad)


def pair_problem(pairs=3, length=11, v=37, h=8, *, dtype=torch.float64, bias=True, ignore_frac=0.3, seed=0):
    """Rows of 2 * pairs sequences of `length` tokens; the ordinary op's inputs plus segments."""
    p = make_problem(2 * pairs * length, v, h, dtype=dtype, bias=bias, ignore_frac=ignore_frac, seed=seed)
    p["segments"] = torch.arange(2 * pairs).repeat_interleave(length)
    p["ref"] = torch.randn(2 * pairs, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) * 3
    return p


def loss_and_grads(p, *, scale=1.0, sequence_loss=None, loss=dpo_like, extra=None, **opts):
    """head_logprobs -> fp64 sequence sums -> scale * loss; values and gradients of every input."""
    wrt = [t for t in (p["hidden"], p["weight"], p["bias"]) if t is not None and t.requires_grad]
    out = head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"], sequence_loss=sequence_loss, **opts)
    sums = torch.zeros(p["ref"].shape[0], dtype=torch.float64, device=out.logps.device)
    sums = sums.index_add(0, p["segments"], out.logps.double())
    total = scale * loss(sums.to(out.logps.dtype), p["ref"].to(out.logps.dtype))
    if extra is not None:
        total = total + extra(out.logps)
    return out, total.detach(), torch.autograd.grad(total, wrt)


OPTIONS = {
    "plain": {},
    "softcap_temperature_scale": dict(softcap=3.0, temperature=0.7, logit_scale=1.3),
    "stats": dict(entropy=True, logit_mean=True, argmax=True),
}


@pytest.mark.parametrize("budget_rows", [None, 20, 40], ids=["one_block", "one_pair_per_block", "two_pairs"])
@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_values_and_every_gradient_equal_the_ordinary_op(options, dtype, budget_rows):
    p = pair_problem(dtype=dtype)
    kw = OPTIONS[options]
    v = p["weight"].shape[0]
    # A pair keeps ~15 of its 22 rows; the torch backend's block holds cdt bytes per logit.
    budget = None if budget_rows is None else budget_rows * v * dtype.itemsize * (2 if "softcap" in kw else 1)
    with HeadCalls() as calls:
        want_out, want_loss, want = loss_and_grads(p, backend="torch", **kw)
        got_out, got_loss, got = loss_and_grads(p, sequence_loss=declared(p["segments"], p["ref"]), backend="torch",
                                                block_budget_bytes=budget, **kw)
    assert got_out.loss_aware and not want_out.loss_aware
    assert calls == Counter(forward=1, backward=1), calls
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert rel_err(got_out.logps, want_out.logps) <= tol
    assert abs(got_loss - want_loss) <= tol * abs(want_loss)
    for name, g, w in zip(("hidden", "weight", "bias"), got, want):
        assert g.dtype == w.dtype, name
        assert rel_err(g, w) <= tol, name
    for stat in ("entropy", "logit_mean"):
        if getattr(want_out, stat) is not None:
            assert rel_err(getattr(got_out, stat), getattr(want_out, stat)) <= tol, stat
    if want_out.argmax_match is not None:
        assert torch.equal(got_out.argmax_match, want_out.argmax_match)


@pytest.mark.parametrize("scale", [1.0, 0.125, 3.7, -2.0, 0.0])
def test_any_scale_of_the_declared_loss_is_fitted(scale):
    # A trainer's normaliser, a backend's loss scaling, gradient ascent, a zero weight.
    p = pair_problem(seed=3)
    _, _, want = loss_and_grads(p, scale=scale, backend="torch")
    out, _, got = loss_and_grads(p, scale=scale, sequence_loss=declared(p["segments"], p["ref"]), backend="torch")
    assert out.loss_aware
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-12
        if scale == 0.0:
            assert g.abs().max() == 0  # zero, yet connected


def test_a_loss_other_than_the_declared_one_raises_at_the_end_of_backward():
    p = pair_problem(seed=4)
    extra = lambda logps: 1e-2 * logps.square().sum()  # noqa: E731  a per-token term not in the declaration
    with HeadCalls() as calls, pytest.raises(DeclaredLossMismatch, match="not the gradient of its declared SequenceLoss"):
        loss_and_grads(p, extra=extra, sequence_loss=declared(p["segments"], p["ref"]), backend="torch")
    assert calls == Counter(forward=1, backward=1, mismatch=1)
    # Nothing is left pending: the next backward is checked on its own.
    loss_and_grads(p, sequence_loss=declared(p["segments"], p["ref"]), backend="torch")


def test_a_different_beta_is_caught_not_trained_on():
    p = pair_problem(seed=5)
    real = lambda sums, ref: dpo_like(sums, ref, beta=0.3)  # noqa: E731
    with pytest.raises(DeclaredLossMismatch):
        loss_and_grads(p, loss=real, sequence_loss=declared(p["segments"], p["ref"]), backend="torch")


def test_the_check_runs_before_backward_returns_and_before_grads_are_used():
    # .backward() itself raises: a training loop never reaches its optimizer step.
    p = pair_problem(seed=13)
    out = head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"], backend="torch",
                        sequence_loss=declared(p["segments"], p["ref"]))
    with pytest.raises(DeclaredLossMismatch):
        out.logps.square().sum().backward()


def test_a_group_over_the_budget_runs_the_ordinary_op():
    p = pair_problem(seed=6)
    v = p["weight"].shape[0]
    with HeadCalls() as calls:
        out, _, got = loss_and_grads(p, sequence_loss=declared(p["segments"], p["ref"]), backend="torch",
                                     block_budget_bytes=4 * v * 8)  # 4 rows: no pair fits
        _, _, want = loss_and_grads(p, backend="torch")
    assert not out.loss_aware
    assert calls == Counter(over_budget=1)
    for g, w in zip(got, want):
        assert rel_err(g, w) == 0


def test_no_gradient_wanted_low_rank_or_reference_run_the_ordinary_op():
    p = pair_problem(seed=7)
    sl = declared(p["segments"], p["ref"])
    with torch.no_grad():
        assert not head_logprobs(p["hidden"], p["weight"], p["labels"], sequence_loss=sl, backend="torch").loss_aware
    frozen = [t.detach() for t in (p["hidden"], p["weight"])]
    assert not head_logprobs(*frozen, p["labels"], sequence_loss=sl, backend="torch").loss_aware
    n, v = p["hidden"].shape[0], p["weight"].shape[0]
    lr = LowRank(torch.randn(n, 2, dtype=torch.float64), torch.randn(v, 2, dtype=torch.float64), 0.5)
    assert not head_logprobs(p["hidden"], p["weight"], p["labels"], low_rank=lr, sequence_loss=sl,
                             backend="torch").loss_aware
    assert not head_logprobs(p["hidden"], p["weight"], p["labels"], sequence_loss=sl, backend="reference").loss_aware


def test_only_hidden_requires_grad():
    # LoRA on the attention, head frozen: grad_W is neither computed nor returned.
    p = pair_problem(seed=8, bias=False)
    p["weight"] = p["weight"].detach()
    _, _, want = loss_and_grads(p, backend="torch")
    out, _, got = loss_and_grads(p, sequence_loss=declared(p["segments"], p["ref"]), backend="torch")
    assert out.loss_aware and len(got) == 1
    assert rel_err(got[0], want[0]) <= 1e-12


def test_a_retained_graph_gives_the_same_gradients_twice():
    p = pair_problem(seed=9)
    out = head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"], backend="torch",
                        sequence_loss=declared(p["segments"], p["ref"]))
    sums = torch.zeros(p["ref"].shape[0], dtype=torch.float64).index_add(0, p["segments"], out.logps.double())
    total = 0.5 * dpo_like(sums, p["ref"])
    first = torch.autograd.grad(total, [p["hidden"], p["weight"]], retain_graph=True)
    second = torch.autograd.grad(total, [p["hidden"], p["weight"]])
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_bf16_error_no_worse_than_the_ordinary_bf16_op():
    # Same criterion as the op's own: against an fp64 truth, no worse than the per-token op.
    p = pair_problem(pairs=4, length=33, v=300, h=32, dtype=torch.bfloat16, bias=False, seed=10)
    truth = pair_problem(pairs=4, length=33, v=300, h=32, dtype=torch.float64, bias=False, seed=10)
    for key in ("hidden", "weight"):
        truth[key] = p[key].detach().double().requires_grad_()
    _, _, exact = loss_and_grads(truth, backend="torch")
    _, _, ordinary = loss_and_grads(p, backend="torch")
    out, _, got = loss_and_grads(p, sequence_loss=declared(p["segments"], p["ref"]), backend="torch")
    assert out.loss_aware
    assert_bf16_no_worse(got, ordinary, exact)


def assert_bf16_no_worse(got, ordinary, exact, tol: float = 1e-3) -> None:
    """Each bf16 gradient of the loss-aware op is no further from the fp64 truth than the
    ordinary op's, plus `tol` (the op tests' criterion)."""
    for g, o, t in zip(got, ordinary, exact):
        assert g.dtype == torch.bfloat16
        assert fro_err(g.cpu(), t) <= fro_err(o.cpu(), t) + tol


def test_memory_is_one_block_of_whole_groups_never_n_by_v():
    pairs, length, v, h = 8, 256, 32000, 16  # N = 4096 rows
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2 * pairs * length, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / 4).requires_grad_()
    labels = torch.randint(0, v, (2 * pairs * length,), generator=gen)
    segments = torch.arange(2 * pairs).repeat_interleave(length)
    ref = torch.randn(2 * pairs, generator=gen, dtype=torch.float64)
    sl = declared(segments, ref)
    pair_rows = 2 * length
    fwd, bwd = NumelRecorder(), NumelRecorder()
    with fwd:  # budget: one pair per block
        out = head_logprobs(hidden, weight, labels, sequence_loss=sl, backend="torch",
                            block_budget_bytes=int(1.5 * pair_rows) * v * 4)
        sums = torch.zeros(2 * pairs, dtype=torch.float64).index_add(0, segments, out.logps.double())
        total = dpo_like(sums.float(), ref.float())
    with bwd:
        total.backward()
    assert out.loss_aware
    assert fwd.max_numel == pair_rows * v  # one pair's logits: 1/8 of N x V
    assert bwd.max_numel <= v * h  # nothing logits-sized: the gradients were formed in the forward


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda s: s._replace(segments=s.segments[:-1]), ValueError, r"segments must be \[N\]"),
        (lambda s: s._replace(segments=s.segments.int()), TypeError, "segments must be a 1-D torch.long"),
        (lambda s: s._replace(groups=s.groups.float()), TypeError, "groups must be a 1-D torch.long"),
        (lambda s: s._replace(segments=s.segments + 100), ValueError, r"segments must lie in \[0, S\)"),
        (lambda s: s._replace(grad=None), TypeError, "grad must be callable"),
        (lambda s: "not a loss", TypeError, "sequence_loss must be a fusedalign.ops.SequenceLoss"),
    ],
)
def test_bad_declarations_raise_clear_errors(change, error, match):
    p = pair_problem(seed=11)
    with pytest.raises(error, match=match):
        head_logprobs(p["hidden"], p["weight"], p["labels"], backend="torch",
                      sequence_loss=change(declared(p["segments"], p["ref"])))


def test_a_non_finite_upstream_gradient_propagates_and_is_not_a_mismatch():
    # fp16 loss scaling overflows, a NaN loss: the gradients come back non-finite, as the
    # ordinary op's would, for GradScaler (or the user) to see.
    p = pair_problem(seed=14)
    with HeadCalls() as calls:
        _, _, got = loss_and_grads(p, scale=float("inf"), sequence_loss=declared(p["segments"], p["ref"]),
                                   backend="torch")
    assert calls["mismatch"] == 0 and calls["backward"] == 1
    assert all(not torch.isfinite(g).all() for g in got)


def test_a_declaration_that_holds_raises_nothing_and_warns_nothing():
    p = pair_problem(seed=12)
    with warnings.catch_warnings(), HeadCalls() as calls:
        warnings.simplefilter("error")
        loss_and_grads(p, scale=0.25, sequence_loss=declared(p["segments"], p["ref"]), backend="torch")
    assert calls == Counter(forward=1, backward=1)


class PlainBlocks(BlockMath):
    """A backend's block math written from the `BlockMath` docstrings alone: unchunked, by
    the formulas there. If the driver ever asks more of a backend than the protocol says,
    this stops matching the built-in backends."""

    def bytes_per_logit(self, dtype, opts):
        return 8

    def forward(self, hidden, weight, labels, bias, opts):
        u = (hidden @ weight.t()).double() + (0.0 if bias is None else bias.double())  # [R, V]
        a = opts.logit_scale * u
        z = a if opts.softcap is None else opts.softcap * torch.tanh(a / opts.softcap)
        logp_all = torch.log_softmax(z / opts.temperature, dim=-1)
        valid = labels != opts.ignore_index
        logps = torch.where(valid, logp_all.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
        cdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        entropy = -(logp_all.exp() * logp_all).sum(-1).to(cdt) if opts.entropy else None
        mean = z.mean(-1).to(cdt) if opts.logit_mean else None
        match = (z.argmax(-1) == labels) & valid if opts.argmax else None
        return BlockForward((a, logp_all, hidden.dtype), logps.to(cdt), entropy, mean, match)

    def gradient(self, state, labels, coef, opts, need_bias):
        a, logp_all, dtype = state
        valid = labels != opts.ignore_index
        onehot = F.one_hot(labels.clamp(min=0), a.shape[1]).double()
        G = torch.where(valid, coef.double(), 0.0)[:, None] * (opts.logit_scale / opts.temperature) * (onehot - logp_all.exp())
        if opts.softcap is not None:
            G = G * (1 - torch.tanh(a / opts.softcap) ** 2)
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        return G.to(dtype), (G.sum(0).to(cdt) if need_bias else None)


def test_the_block_protocol_is_all_a_backend_needs(monkeypatch):
    from fusedalign.ops import chunked, registry

    assert isinstance(chunked.TorchBlocks(), BlockMath)
    plain = registry.Backend(key="plain-blocks", name="plain-blocks", run=chunked.chunked_head_logprobs,
                             blocks=PlainBlocks())
    monkeypatch.setitem(registry._BACKENDS, "plain-blocks", plain)
    kw = dict(softcap=3.0, temperature=0.7, logit_scale=1.3, entropy=True, logit_mean=True, argmax=True)
    p = pair_problem(seed=15)
    want_out, _, want = loss_and_grads(p, backend="torch", **kw)
    got_out, _, got = loss_and_grads(p, sequence_loss=declared(p["segments"], p["ref"]), backend="plain-blocks",
                                     block_budget_bytes=20 * 37 * 8, **kw)  # one pair per block
    assert got_out.loss_aware and got_out.backend == "plain-blocks"
    assert rel_err(got_out.logps, want_out.logps) <= 1e-12
    for stat in ("entropy", "logit_mean"):
        assert rel_err(getattr(got_out, stat), getattr(want_out, stat)) <= 1e-12, stat
    assert torch.equal(got_out.argmax_match, want_out.argmax_match)
    for name, g, w in zip(("hidden", "weight", "bias"), got, want):
        assert rel_err(g, w) <= 1e-12, name


def test_the_call_counter_restores_what_it_wraps():
    from fusedalign.ops import api, loss_aware

    originals = (api.loss_aware_head_logprobs, loss_aware._LossAwareHead.__dict__["backward"], loss_aware._verify_pending)
    p = pair_problem(seed=16)
    with HeadCalls() as calls:
        loss_and_grads(p, sequence_loss=declared(p["segments"], p["ref"]), backend="torch")
        assert api.loss_aware_head_logprobs is not originals[0]
    assert calls == Counter(forward=1, backward=1)
    assert (api.loss_aware_head_logprobs, loss_aware._LossAwareHead.__dict__["backward"],
            loss_aware._verify_pending) == originals
    loss_and_grads(p, sequence_loss=declared(p["segments"], p["ref"]), backend="torch")
    assert calls == Counter(forward=1, backward=1)  # nothing counted once it has stopped
