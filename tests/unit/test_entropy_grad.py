"""`head_logprobs(..., entropy_grad=True)`: the entropy carries a gradient (GRPO's entropy bonus).

The truth is `reference_head_logprobs` in float64 (autograd through the materialised
logits), itself checked against an oracle written here. Every backend must give its
values and every gradient of a loss that uses both outputs, sum g logp + sum g^H H, on odd
shapes with a bias, a softcap, a temperature, a logit scale, a LoRA adapter and ignored
rows: the torch backend on CPU, the Triton kernels under the CPU interpreter (one block and
row blocks), and on CUDA (skipped without a GPU) in fp32 and by the bf16 criterion.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusedalign.ops import SequenceLoss, head_logprobs, reference_head_logprobs
from tests.unit.test_ops import (
    ALL_CASES,
    fro_err,
    grad_inputs,
    low_rank_of,
    make_problem,
    opts_of,
    oracle_logits,
    rel_err,
)

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not (CUDA and HAS_TRITON), reason="needs a CUDA device and Triton")
GRAD_NAMES = ("hidden", "weight", "bias", "down", "up")
CASES = ["everything", "softcap", "temperature", "logit_scale", "bias", "low_rank", "mixed_ignored",
         "vocab_prime", "chunk_of_one", "one_token", "all_ignored", "random2", "random5"]


def entropy_upstream(n: int, seed: int = 99) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def leaves_as(p: dict, dtype: torch.dtype, device="cpu") -> dict:
    """A copy of the problem whose inputs are fresh leaves in `dtype` on `device`."""
    out = dict(p)
    for k in GRAD_NAMES:
        out[k] = None if p[k] is None else p[k].detach().to(device, dtype).requires_grad_()
    out["labels"] = p["labels"].to(device)
    return out


def run(p, opts, g_ent, *, fn=head_logprobs, only_entropy=False, **kw):
    """(output, gradients of every input) of sum g logp + sum g_ent H through `fn`."""
    out = fn(p["hidden"], p["weight"], p["labels"], p["bias"], temperature=opts["temperature"],
             softcap=opts["softcap"], logit_scale=opts["logit_scale"], low_rank=low_rank_of(p, opts["lr_scale"]),
             entropy_grad=True, **kw)
    dev = out.logps.device
    total = (out.entropy * g_ent.to(dev, out.entropy.dtype)).sum()
    if not only_entropy:
        total = total + (out.logps * p["g"].to(dev, out.logps.dtype)).sum()
    return out, list(torch.autograd.grad(total, grad_inputs(p)))


def truth(p, opts, g_ent, only_entropy=False):
    """The float64 reference on the same (rounded) inputs."""
    return run(leaves_as(p, torch.float64), opts, g_ent, fn=reference_head_logprobs, only_entropy=only_entropy)


def assert_parity(out, grads, want_out, want_grads, p, rtol):
    valid = (p["labels"] != -100).to(out.logps.device)
    assert out.entropy.requires_grad or not valid.any()
    assert rel_err(out.logps.cpu(), want_out.logps) <= rtol
    assert rel_err(torch.where(valid, out.entropy, 0.0).cpu(), want_out.entropy) <= rtol
    for name, got, ref, leaf in zip(GRAD_NAMES, grads, want_grads, grad_inputs(p)):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape, name
        assert rel_err(got.cpu(), ref) <= rtol, name


# --------------------------------------------------------------------------- torch, reference


@pytest.mark.parametrize("only_entropy", [False, True], ids=["logps_and_entropy", "entropy_only"])
@pytest.mark.parametrize("case", CASES)
def test_torch_backend_float64_matches_the_reference(case, only_entropy):
    n, v, h, chunk, prob, opt = ALL_CASES[case]
    p = make_problem(n, v, h, **prob)
    opts, g_ent = opts_of(**opt), entropy_upstream(n)
    want_out, want = truth(p, opts, g_ent, only_entropy)
    out, got = run(p, opts, g_ent, backend="torch", chunk_size=chunk, only_entropy=only_entropy)
    assert out.backend == "torch-chunked"
    assert_parity(out, got, want_out, want, p, rtol=1e-10)


@pytest.mark.parametrize("case", ["everything", "softcap", "low_rank", "random2"])
def test_the_reference_entropy_gradient_is_the_formula(case):
    """The reference itself against an oracle written here: autograd through H(softmax(z / T))."""
    n, v, h, chunk, prob, opt = ALL_CASES[case]
    p = make_problem(n, v, h, **prob)
    opts, g_ent = opts_of(**opt), entropy_upstream(n)
    out, got = truth(p, opts, g_ent)
    q = leaves_as(p, torch.float64)
    lr = low_rank_of(q, opts["lr_scale"])
    z = oracle_logits(q["hidden"], q["weight"], q["bias"], lr, opts["logit_scale"], opts["softcap"])
    logq = torch.log_softmax(z / opts["temperature"], dim=-1)
    valid = p["labels"] != -100
    entropy = torch.where(valid, -(logq.exp() * logq).sum(-1), 0.0)
    logps = torch.where(valid, logq.gather(1, p["labels"].clamp(min=0)[:, None]).squeeze(1), 0.0)
    want = torch.autograd.grad((logps * p["g"]).sum() + (entropy * g_ent).sum(), grad_inputs(q))
    assert rel_err(out.entropy, entropy) <= 1e-12
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert rel_err(a, b) <= 1e-12, name


def test_ignored_rows_get_no_entropy_gradient_even_from_nan():
    n, v, h, chunk, prob, opt = ALL_CASES["everything"]
    p = make_problem(n, v, h, **prob)
    ignored = p["labels"] == -100
    g_ent = torch.where(ignored, torch.nan, entropy_upstream(n))
    out, grads = run(p, opts_of(**opt), g_ent, backend="torch", chunk_size=chunk)
    assert (out.entropy[ignored] == 0).all()
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.count_nonzero(grads[0][ignored]) == 0


def test_bf16_error_no_worse_than_unfused_bf16():
    """Cut Cross-Entropy's criterion, on the loss using both outputs, against float64."""
    p = make_problem(96, 300, 64, dtype=torch.bfloat16, bias=True, rank=4, ignore_frac=0.2, logit_std=4.0, seed=7)
    opts, g_ent = opts_of(temperature=0.9, softcap=6.0, logit_scale=1.1, lr_scale=0.5), entropy_upstream(96)
    assert_bf16_no_worse(p, opts, g_ent, run(p, opts, g_ent, backend="torch", chunk_size=17))


def assert_bf16_no_worse(p, opts, g_ent, got, tol=1e-3):
    """err(op) <= err(naive bf16 logits through the reference) + tol, for every output and gradient."""
    exact_out, exact = truth(p, opts, g_ent)
    naive_out, naive = run(leaves_as(p, torch.bfloat16), opts, g_ent, fn=reference_head_logprobs)
    out, grads = got
    valid = (p["labels"] != -100).to(out.logps.device)
    assert fro_err(out.logps.cpu(), exact_out.logps) <= fro_err(naive_out.logps, exact_out.logps) + tol
    entropy = torch.where(valid, out.entropy, 0.0).cpu()
    assert fro_err(entropy, exact_out.entropy) <= fro_err(naive_out.entropy, exact_out.entropy) + tol
    for name, g, t, nv in zip(GRAD_NAMES, grads, exact, naive):
        assert g.dtype == torch.bfloat16, name
        assert fro_err(g.cpu(), t) <= fro_err(nv, t) + tol, name


def test_entropy_grad_implies_entropy_and_plain_entropy_stays_detached():
    p = make_problem(7, 19, 4)
    plain = head_logprobs(p["hidden"], p["weight"], p["labels"], entropy=True)
    with_grad = head_logprobs(p["hidden"], p["weight"], p["labels"], entropy_grad=True)
    assert not plain.entropy.requires_grad and with_grad.entropy.requires_grad
    assert torch.equal(plain.entropy, with_grad.entropy.detach())


def test_entropy_grad_with_a_declared_sequence_loss_is_refused():
    p = make_problem(8, 11, 4)
    declared = SequenceLoss(torch.zeros(8, dtype=torch.long), torch.zeros(1, dtype=torch.long), lambda s: -s)
    with pytest.raises(ValueError, match="sequence_loss and entropy_grad"):
        head_logprobs(p["hidden"], p["weight"], p["labels"], entropy_grad=True, sequence_loss=declared)


# --------------------------------------------------------------------------- Triton


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="needs Triton; with CUDA the kernels are tested compiled")
def test_interpreter_entropy_gradient_matches_the_reference():
    """The kernels under TRITON_INTERPRET=1 on CPU tensors, in a fresh process (see test_ops_triton)."""
    from tests.unit.test_ops_triton import run_under_interpreter

    run_under_interpreter("tests.unit.test_entropy_grad", "interpreter_checks", "entropy grad interpreter checks passed")


def interpreter_checks():
    """Run in the subprocess above: fp32 against the float64 reference in both backward
    regimes (one block; row blocks, forced by raising MIN_COLS), then the bf16 criterion."""
    from fusedalign.ops import triton_chunks
    from tests.unit.test_ops_triton import patch_interpreter

    patch_interpreter()
    for min_cols, row_blocked in ((1, False), (64, True)):
        triton_chunks.MIN_COLS = min_cols
        for case in ("everything", "low_rank", "mixed_ignored", "random3"):
            n, v, h, chunk, prob, opt = ALL_CASES[case]
            p = make_problem(n, v, h, dtype=torch.float32, **prob)
            opts, g_ent = opts_of(**opt), entropy_upstream(n)
            assert (scored_row_blocks(p, chunk) > 1) == row_blocked, case  # the regime under test runs
            want_out, want = truth(p, opts, g_ent)
            out, got = run(p, opts, g_ent, fn=interpreted_triton, chunk_size=chunk)
            assert_parity(out, got, want_out, want, p, rtol=3e-6)
    p = make_problem(48, 150, 32, dtype=torch.bfloat16, bias=True, rank=4, ignore_frac=0.2, logit_std=4.0, seed=7)
    opts, g_ent = opts_of(temperature=0.9, softcap=6.0, logit_scale=1.1, lr_scale=0.5), entropy_upstream(48)
    assert scored_row_blocks(p, 9) > 1
    assert_bf16_no_worse(p, opts, g_ent, run(p, opts, g_ent, fn=interpreted_triton, chunk_size=9))
    print("entropy grad interpreter checks passed")


def scored_row_blocks(p, chunk) -> int:
    """How many row blocks the Triton backend takes the problem's scored rows in."""
    from fusedalign.ops import triton_chunks
    from fusedalign.ops.options import HeadOptions, resolve_chunk_rows

    n, v = int((p["labels"] != -100).sum()), p["weight"].shape[0]
    return len(triton_chunks.row_blocks(n, v, HeadOptions(chunk_rows=resolve_chunk_rows(n, v, torch.device("cpu"), chunk))))


def interpreted_options(n: int, v: int, opts, chunk, has_lora: bool):
    from fusedalign.ops.options import HeadOptions, resolve_chunk_rows

    return HeadOptions(temperature=opts["temperature"], softcap=opts["softcap"], logit_scale=opts["logit_scale"],
                       low_rank_scale=opts["lr_scale"] if has_lora else 0.0, entropy=True,
                       entropy_grad=True, chunk_rows=resolve_chunk_rows(n, v, torch.device("cpu"), chunk))


def interpreted_triton(hidden, weight, labels, bias, *, temperature, softcap, logit_scale, low_rank,
                       entropy_grad, chunk_size):
    """The Triton backend's run function on CPU tensors, as head_logprobs would call it on
    the scored rows (the registry refuses CPU for "triton"); ignored rows scattered back as 0."""
    from fusedalign.ops.api import _scatter_rows
    from fusedalign.ops.options import LowRank
    from fusedalign.ops.triton_head import triton_head_logprobs

    rows = (labels != -100).nonzero().squeeze(1)
    lr = None if low_rank is None else LowRank(low_rank.down[rows], low_rank.up, low_rank.scale)
    opts = dict(temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                lr_scale=0.0 if low_rank is None else low_rank.scale)
    ho = interpreted_options(rows.numel(), weight.shape[0], opts, chunk_size, low_rank is not None)
    out = triton_head_logprobs(hidden[rows], weight, labels[rows], bias, lr, ho)
    return _scatter_rows(out, rows, labels.shape[0])


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("min_cols", [1, 64], ids=["one_block", "row_blocks"])
@pytest.mark.parametrize("case", ["everything", "low_rank", "mixed_ignored", "softcap", "random3", "vocab_prime"])
def test_cuda_fp32_matches_the_reference(case, min_cols, monkeypatch):
    from fusedalign.ops import triton_chunks

    monkeypatch.setattr(triton_chunks, "MIN_COLS", min_cols)
    n, v, h, chunk, prob, opt = ALL_CASES[case]
    p = make_problem(n, v, h, dtype=torch.float32, **prob)
    assert (scored_row_blocks(p, chunk) > 1) == (min_cols > 1), case  # the regime under test runs
    opts, g_ent = opts_of(**opt), entropy_upstream(n)
    want_out, want = truth(p, opts, g_ent)
    pd = leaves_as(p, torch.float32, "cuda")
    out, got = run(pd, opts, g_ent, backend="triton", chunk_size=chunk)
    assert out.backend == "triton"
    assert_parity(out, got, want_out, want, p, rtol=1e-5)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n, v, h, chunk, seed", [(96, 300, 64, 17, 7), (512, 6000, 128, 40, 1)])
def test_cuda_bf16_error_no_worse_than_unfused_bf16(n, v, h, chunk, seed):
    p = make_problem(n, v, h, dtype=torch.bfloat16, bias=True, rank=4, ignore_frac=0.2, logit_std=4.0, seed=seed)
    opts, g_ent = opts_of(temperature=0.9, softcap=6.0, logit_scale=1.1, lr_scale=0.5), entropy_upstream(n)
    pd = leaves_as(p, torch.bfloat16, "cuda")
    got = run(pd, opts, g_ent, backend="triton", chunk_size=chunk)
    assert got[0].backend == "triton"
    assert_bf16_no_worse(p, opts, g_ent, got)


def test_formula_in_the_docstring_is_the_derivative():
    """d/dz H(softmax(z / T)) = -(p / T)(log p + H), checked by autograd on one row."""
    z = torch.randn(13, dtype=torch.float64, requires_grad=True)
    t = 0.7
    logp = F.log_softmax(z / t, dim=0)
    entropy = -(logp.exp() * logp).sum()
    (grad,) = torch.autograd.grad(entropy, z)
    p = logp.exp().detach()
    assert torch.allclose(grad, -(p / t) * (logp.detach() + entropy.detach()), rtol=1e-12, atol=1e-14)
