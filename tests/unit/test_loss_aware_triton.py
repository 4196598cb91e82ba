"""The loss-aware mode on the "triton" backend: CUDA parity and memory, and the interpreter on CPU.

Same standard as test_loss_aware.py (the torch backend): the loss-aware op gives the
ordinary op's values and every gradient (fp32 to ~1e-5; bf16 no worse than the ordinary
bf16 op against an fp64 truth), and its extra memory is one block plus the fp32 gradients.
Skipped when Triton is not installed; the CUDA cases without a GPU.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fusedalign.ops import DeclaredLossMismatch, head_logprobs
from tests.head_calls import HeadCalls
from tests.unit.test_loss_aware import (
    OPTIONS,
    assert_bf16_no_worse,
    declared,
    dpo_like,
    loss_and_grads,
    pair_problem,
)
from tests.unit.test_ops import rel_err

pytest.importorskip("triton")
from tests.unit.test_ops_triton import run_under_interpreter  # noqa: E402  (needs triton)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def to(p: dict, device: str, dtype: torch.dtype | None = None) -> dict:
    """The problem on `device`: hidden, weight and bias as fresh leaves (in `dtype` if given)."""
    out = {}
    for key, t in p.items():
        if t is None or not isinstance(t, torch.Tensor):
            out[key] = t
        elif key in ("hidden", "weight", "bias"):
            out[key] = t.detach().to(device, dtype or t.dtype).requires_grad_()
        else:
            out[key] = t.to(device)
    return out


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("pairs_per_block", [None, 1], ids=["one_block", "pair_per_block"])
@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
def test_cuda_fp32_equals_the_ordinary_triton_op(options, pairs_per_block):
    p = to(pair_problem(pairs=5, length=57, v=1031, h=48, dtype=torch.float32, seed=20), "cuda")
    kw = OPTIONS[options]
    budget = None if pairs_per_block is None else 2 * 57 * 1031 * 4
    with HeadCalls() as calls:
        want_out, _, want = loss_and_grads(p, backend="triton", **kw)
        got_out, _, got = loss_and_grads(p, sequence_loss=declared(p["segments"], p["ref"]), backend="triton",
                                         block_budget_bytes=budget, **kw)
    assert got_out.loss_aware and got_out.backend == "triton"
    assert calls == Counter(forward=1, backward=1)
    assert rel_err(got_out.logps.cpu(), want_out.logps.cpu()) <= 1e-5
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and rel_err(g.cpu(), w.cpu()) <= 1e-5
    for stat in ("entropy", "logit_mean"):
        if getattr(want_out, stat) is not None:
            assert rel_err(getattr(got_out, stat).cpu(), getattr(want_out, stat).cpu()) <= 1e-5, stat
    if want_out.argmax_match is not None:
        assert torch.equal(got_out.argmax_match, want_out.argmax_match)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cuda_bf16_error_no_worse_than_the_ordinary_bf16_op(seed):
    truth = pair_problem(pairs=4, length=300, v=32000, h=256, dtype=torch.float64, bias=False, seed=seed)
    p = to(truth, "cuda", torch.bfloat16)
    truth["hidden"] = p["hidden"].detach().cpu().double().requires_grad_()
    truth["weight"] = p["weight"].detach().cpu().double().requires_grad_()
    _, _, exact = loss_and_grads(truth, backend="torch")
    _, _, ordinary = loss_and_grads(p, backend="triton")
    out, _, got = loss_and_grads(p, sequence_loss=declared(p["segments"], p["ref"]), backend="triton")
    assert out.loss_aware
    assert_bf16_no_worse(got, ordinary, exact)


@needs_cuda
@pytest.mark.gpu
def test_cuda_mismatch_raises():
    p = to(pair_problem(pairs=3, length=40, v=999, h=32, dtype=torch.float32, seed=21), "cuda")
    extra = lambda logps: 1e-2 * logps.square().sum()  # noqa: E731
    with pytest.raises(DeclaredLossMismatch):
        loss_and_grads(p, extra=extra, sequence_loss=declared(p["segments"], p["ref"]), backend="triton")


@needs_cuda
@pytest.mark.gpu
def test_cuda_peak_memory_is_one_block_plus_fp32_gradients():
    pairs, length, v, h = 8, 512, 32000, 256
    gen = torch.Generator().manual_seed(0)
    n = 2 * pairs * length
    hidden = torch.randn(n, h, generator=gen).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / 16).cuda().bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen).cuda()
    segments = torch.arange(2 * pairs).repeat_interleave(length).cuda()
    ref = torch.randn(2 * pairs, generator=gen, dtype=torch.float64).cuda()
    sl = declared(segments, ref)
    block = 2 * length * v * 2  # one pair's bf16 logits
    budget = int(1.5 * block)

    def step():
        out = head_logprobs(hidden, weight, labels, sequence_loss=sl, block_budget_bytes=budget, backend="triton")
        sums = torch.zeros(2 * pairs, dtype=torch.float64, device="cuda").index_add(0, segments, out.logps.double())
        return torch.autograd.grad(dpo_like(sums.float(), ref.float()), [hidden, weight])

    step()  # compiles, and creates cuBLAS workspaces, which stay allocated
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    gh, gw = step()
    torch.cuda.synchronize()
    returned = gh.numel() * gh.element_size() + gw.numel() * gw.element_size()
    extra = torch.cuda.max_memory_allocated() - base - returned
    fp32_grads = (n * h + v * h) * 4
    assert extra <= block + fp32_grads + 8 * 2**20, extra
    assert extra < n * v * 2 // 4  # far below the bf16 logits


# --------------------------------------------------------------------------- interpreter


@pytest.mark.skipif(CUDA, reason="CUDA present: the kernels are tested compiled, above")
def test_interpreter_blocks_match_the_torch_backend():
    """The Triton block math under TRITON_INTERPRET=1 on CPU tensors, in a fresh process."""
    run_under_interpreter("tests.unit.test_loss_aware_triton", "interpreter_checks",
                          "loss-aware interpreter checks passed")


def interpreter_checks():
    """Run in the subprocess above: fp32 with every option, multi-block; bf16 criterion."""
    from fusedalign.ops.loss_aware import loss_aware_head_logprobs
    from fusedalign.ops.options import HeadOptions
    from fusedalign.ops.triton_head import TritonBlocks
    from tests.unit.test_ops_triton import patch_interpreter

    patch_interpreter()

    def run(p, budget, **kw):
        opts = HeadOptions(**kw)
        scored = (p["labels"] != -100).nonzero().squeeze(1)  # head_logprobs passes scored rows only
        sl = declared(p["segments"], p["ref"])
        sl = sl._replace(segments=sl.segments[scored])
        out = loss_aware_head_logprobs(TritonBlocks(), p["hidden"][scored], p["weight"], p["labels"][scored],
                                       p["bias"], sl, opts, "triton", budget)
        logps = torch.zeros(p["labels"].shape[0], dtype=out.logps.dtype).index_copy(0, scored, out.logps)
        sums = torch.zeros(p["ref"].shape[0], dtype=torch.float64).index_add(0, p["segments"], logps.double())
        wrt = [t for t in (p["hidden"], p["weight"], p["bias"]) if t is not None]
        return out, torch.autograd.grad(0.3 * dpo_like(sums.to(logps.dtype), p["ref"].to(logps.dtype)), wrt)

    for kw in ({}, dict(softcap=3.0, temperature=0.7, logit_scale=1.3, entropy=True, logit_mean=True, argmax=True)):
        p = pair_problem(dtype=torch.float32, seed=30)
        out, got = run(p, budget=20 * 37 * 4, **kw)  # one pair per block
        assert out.loss_aware
        _, _, want = loss_and_grads(p, scale=0.3, backend="torch", **kw)
        for g, w in zip(got, want):
            assert rel_err(g, w) <= 3e-6, kw

    truth = pair_problem(pairs=3, length=21, v=150, h=32, dtype=torch.float64, seed=31)
    p = {k: (v.detach().bfloat16().requires_grad_() if k in ("hidden", "weight", "bias") else v)
         for k, v in truth.items()}
    for key in ("hidden", "weight", "bias"):
        truth[key] = p[key].detach().double().requires_grad_()
    _, got = run(p, budget=None, softcap=6.0, temperature=0.9)
    _, _, exact = loss_and_grads(truth, scale=0.3, backend="torch", softcap=6.0, temperature=0.9)
    _, _, ordinary = loss_and_grads(p, scale=0.3, backend="torch", softcap=6.0, temperature=0.9)
    assert_bf16_no_worse(got, ordinary, exact)
    print("loss-aware interpreter checks passed")


def test_triton_blocks_declare_the_protocol():
    from fusedalign.ops import BlockMath
    from fusedalign.ops.triton_head import TritonBlocks

    assert isinstance(TritonBlocks(), BlockMath)
