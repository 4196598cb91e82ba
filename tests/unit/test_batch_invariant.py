"""`head_logprobs(..., batch_invariant=True)`: a row's results do not depend on its batch-mates.

GRPO scores the same completions in different batches (the old policy, then the policy)
and needs the first-iteration ratio to be exactly 1. The check: a row's log-prob and every
statistic computed alone equal, bit for bit, the same row inside batches of other sizes
and compositions (shuffled, subsets, other rows added, more than one chunk), with a bias,
a softcap, a temperature, a LoRA adapter and ignored rows; and the mode still computes the
op's function (parity with the oracle of test_ops.py, values and every gradient). On the
torch and reference backends on CPU, the Triton kernels under the CPU interpreter, and on
CUDA (skipped without a GPU). Without the mode a lone fp32 row differed from the same row
in its batch on this CPU (a 1-row GEMM takes another kernel), so the check can fail.
"""

from __future__ import annotations

import pytest
import torch

from fusedalign.ops import LowRank, SequenceLoss, head_logprobs
from fusedalign.ops.options import HeadOptions, resolve_chunk_rows
from tests.unit.test_ops import make_problem, opts_of, rel_err, run_op, run_oracle

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
STATS = dict(entropy=True, logit_mean=True, argmax=True)
# (pool rows, V, H, chunk_size, problem, options): odd H and V, every option, one case per chunking.
SHAPES = {
    "odd_everything": (61, 101, 13, 3, dict(bias=True, rank=3, ignore_frac=0.2, logit_std=5.0),
                       dict(temperature=0.7, softcap=4.0, logit_scale=1.3, lr_scale=0.5)),
    "default_chunks": (45, 257, 5, None, dict(bias=True, ignore_frac=0.1), dict(temperature=1.3)),
    "plain": (40, 300, 32, 8, {}, {}),
}


def call(p, idx, opts, fn, **kw):
    """The op on the pool's rows `idx` (a batch), with every statistic."""
    lr = None if p["down"] is None else LowRank(p["down"][idx], p["up"], opts["lr_scale"])
    return fn(p["hidden"][idx], p["weight"], p["labels"][idx], p["bias"], temperature=opts["temperature"],
              softcap=opts["softcap"], logit_scale=opts["logit_scale"], low_rank=lr, **STATS, **kw)


def batches_holding(row: int, pool: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Batches of the pool's rows that contain `row`: other sizes, orders and mates."""
    others = torch.cat([torch.arange(row), torch.arange(row + 1, pool)])
    out = [torch.arange(pool), torch.randperm(pool, generator=gen)]
    for size in (2, 7, 8, 9, 17, pool // 2):
        mates = others[torch.randperm(others.numel(), generator=gen)[: size - 1]]
        at = int(torch.randint(0, size, (1,), generator=gen))
        out.append(torch.cat([mates[:at], torch.tensor([row]), mates[at:]]))
    return out


def assert_rows_are_their_own(p, opts, fn, rows=(0, 5, -1), **kw):
    """Each of `rows`, alone, equals itself in every batch of `batches_holding`, bit for bit."""
    pool = p["hidden"].shape[0]
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for row in rows:
        row = row % pool
        alone = call(p, torch.tensor([row]), opts, fn, **kw)
        for batch in batches_holding(row, pool, gen):
            out = call(p, batch, opts, fn, **kw)
            at = int((batch == row).nonzero()[0, 0])
            for name in ("logps", "entropy", "logit_mean", "argmax_match"):
                got, want = getattr(out, name)[at], getattr(alone, name)[0]
                assert torch.equal(got.cpu(), want.cpu()), (name, row, batch.numel(), got.item(), want.item())
            checked += 1
    assert checked >= 3 * len(rows)


def backend_fn(backend: str):
    return lambda *a, **kw: head_logprobs(*a, backend=backend, **kw)


# --------------------------------------------------------------------------- torch, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cpu_rows_are_their_own(shape, backend, dtype):
    n, v, h, chunk, prob, opt = SHAPES[shape]
    p = make_problem(n, v, h, dtype=dtype, **prob)
    assert_rows_are_their_own(p, opts_of(**opt), backend_fn(backend), chunk_size=chunk, batch_invariant=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_mode_computes_the_op(shape, backend, dtype):
    """Values, statistics and every gradient equal the oracle's, as without the mode."""
    n, v, h, chunk, prob, opt = SHAPES[shape]
    p = make_problem(n, v, h, dtype=dtype, **prob)
    opts = opts_of(**opt)
    want, want_grads, z = run_oracle(p, opts)
    out, grads = run_op(p, opts, backend, chunk_size=chunk, batch_invariant=True, **STATS)
    rtol = 1e-6 if dtype == torch.float64 else 3e-6
    assert rel_err(out.logps, want) <= rtol
    for got, ref in zip(grads, want_grads):
        assert rel_err(got, ref) <= rtol
    assert_stats_match(out, p, opts, z, rtol)


def assert_stats_match(out, p, opts, z, rtol):
    valid = (p["labels"] != -100).to(out.logps.device)
    logq = torch.log_softmax(z.detach() / opts["temperature"], dim=-1)
    entropy = (-(logq.exp() * logq).sum(-1)).masked_fill(~valid.cpu(), 0.0)
    assert rel_err(out.entropy.cpu(), entropy) <= rtol
    assert rel_err(out.logit_mean.cpu(), z.detach().mean(-1).masked_fill(~valid.cpu(), 0.0)) <= rtol
    assert torch.equal(out.argmax_match.cpu(), (z.argmax(-1) == p["labels"].cpu()) & valid.cpu())


def test_chunk_shapes_do_not_depend_on_n():
    cuda = torch.device("cuda")  # a device object needs no GPU
    for v in (37, 4096, 151_936):
        rows = {resolve_chunk_rows(n, v, cuda, batch_invariant=True) for n in (1, 9, 1000, 250_000)}
        assert len(rows) == 1 and next(iter(rows)) % 8 == 0, (v, rows)
    assert resolve_chunk_rows(5, 37, cuda, chunk_size=3, batch_invariant=True) == 8  # a multiple of 8 rows
    if HAS_TRITON:
        from fusedalign.ops.triton_chunks import MIN_COLS, chunk_cols, row_blocks

        opts = HeadOptions(batch_invariant=True, chunk_rows=resolve_chunk_rows(1, 151_936, cuda, batch_invariant=True))
        widths = {chunk_cols(n, 151_936, opts) for n in (1, 9, 16_384, 1_506_304)}
        assert len(widths) == 1 and next(iter(widths)) >= MIN_COLS, widths
        sizes = {r1 - r0 for n in (1, 9, 16_384, 100_000) for r0, r1 in row_blocks(n, 151_936, opts)[:-1]}
        assert len(sizes) <= 1, sizes  # every block but a last one has the same rows


def test_batch_invariant_with_a_sequence_loss_is_refused():
    p = make_problem(8, 11, 4)
    declared = SequenceLoss(torch.zeros(8, dtype=torch.long), torch.zeros(1, dtype=torch.long), lambda s: -s)
    with pytest.raises(ValueError, match="sequence_loss and batch_invariant"):
        head_logprobs(p["hidden"], p["weight"], p["labels"], batch_invariant=True, sequence_loss=declared)


# --------------------------------------------------------------------------- Triton


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="needs Triton; with CUDA the kernels are tested compiled")
def test_interpreter_rows_are_their_own():
    """The Triton kernels under TRITON_INTERPRET=1 on CPU tensors, in a fresh process (see test_ops_triton)."""
    from tests.unit.test_ops_triton import run_under_interpreter

    run_under_interpreter("tests.unit.test_batch_invariant", "interpreter_checks", "batch invariance interpreter checks passed")


def interpreter_checks():
    """Run in the subprocess above: invariance in fp32 and bf16 (one block and several), and
    parity with the oracle in the mode (values, statistics, every gradient)."""
    from fusedalign.ops import triton_chunks
    from tests.unit.test_ops_triton import patch_interpreter

    patch_interpreter()
    for min_cols in (triton_chunks.MIN_COLS, 96):  # 96: several vocabulary chunks of a fixed width, the last one short
        triton_chunks.MIN_COLS = min_cols
        for dtype in (torch.float32, torch.bfloat16):
            for shape in ("odd_everything", "plain"):
                n, v, h, chunk, prob, opt = SHAPES[shape]
                p = make_problem(n, v, h, dtype=dtype, **prob)
                assert_rows_are_their_own(p, opts_of(**opt), interpreted_triton, rows=(0, -1), chunk_size=chunk)
    assert interpreted_triton.blocks > 1 and interpreted_triton.chunks > 1  # both shapes of batches ran
    n, v, h, chunk, prob, opt = SHAPES["odd_everything"]
    p = make_problem(n, v, h, dtype=torch.float32, **prob)
    opts = opts_of(**opt)
    want, want_grads, z = run_oracle(p, opts)
    out = call(p, torch.arange(n), opts, interpreted_triton, chunk_size=chunk)
    grads = torch.autograd.grad((out.logps * p["g"].float()).sum(), [p[k] for k in ("hidden", "weight", "bias", "down", "up")])
    assert rel_err(out.logps, want) <= 3e-6
    for got, ref in zip(grads, want_grads):
        assert rel_err(got, ref) <= 3e-6
    assert_stats_match(out, p, opts, z, 3e-6)
    print("batch invariance interpreter checks passed")


def interpreted_triton(hidden, weight, labels, bias, *, temperature, softcap, logit_scale, low_rank, chunk_size,
                       **stats):
    """The Triton backend's run function on CPU tensors in batch-invariant mode, on the scored
    rows as head_logprobs passes them (the registry refuses CPU for "triton")."""
    from fusedalign.ops.api import _scatter_rows
    from fusedalign.ops.triton_head import chunk_cols, row_blocks, triton_head_logprobs

    rows = (labels != -100).nonzero().squeeze(1)
    n, v = rows.numel(), weight.shape[0]
    lr = None if low_rank is None else LowRank(low_rank.down[rows], low_rank.up, low_rank.scale)
    ho = HeadOptions(temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                     low_rank_scale=0.0 if lr is None else lr.scale, batch_invariant=True,
                     chunk_rows=resolve_chunk_rows(n, v, torch.device("cpu"), chunk_size, None, True), **stats)
    interpreted_triton.blocks = max(getattr(interpreted_triton, "blocks", 0), len(row_blocks(n, v, ho)))
    chunks = -(-v // chunk_cols(n, v, ho))
    interpreted_triton.chunks = max(getattr(interpreted_triton, "chunks", 0), chunks)
    out = triton_head_logprobs(hidden[rows], weight, labels[rows], bias, lr, ho)
    return _scatter_rows(out, rows, labels.shape[0])


# --------------------------------------------------------------------------- CUDA


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend, dtype", [("triton", torch.bfloat16), ("triton", torch.float32),
                                            ("torch", torch.bfloat16), ("torch", torch.float32),
                                            ("torch", torch.float64)])
@pytest.mark.parametrize("shape", list(SHAPES) + ["long_vocab"])
def test_cuda_rows_are_their_own(shape, backend, dtype):
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("needs Triton")
    if shape == "long_vocab":  # realistic widths: several vocabulary chunks and row blocks
        n, v, h, chunk, prob, opt = 3000, 32_000, 256, None, dict(bias=False, ignore_frac=0.1), {}
        kw = dict(memory_budget_bytes=40 * 32_000 * 4)
    else:
        n, v, h, chunk, prob, opt = SHAPES[shape]
        kw = dict(chunk_size=chunk)
    p = {k: (t.cuda() if isinstance(t, torch.Tensor) else t)
         for k, t in make_problem(n, v, h, dtype=dtype, **prob).items()}
    assert_rows_are_their_own(p, opts_of(**opt), backend_fn(backend), batch_invariant=True, **kw)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_the_mode_computes_the_op(shape, backend):
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("needs Triton")
    n, v, h, chunk, prob, opt = SHAPES[shape]
    p = make_problem(n, v, h, dtype=torch.float32, **prob)
    opts = opts_of(**opt)
    want, want_grads, z = run_oracle(p, opts)
    pd = {k: (t.detach().cuda().requires_grad_() if isinstance(t, torch.Tensor) and t.requires_grad
              else t.cuda() if isinstance(t, torch.Tensor) else t) for k, t in p.items()}
    out, grads = run_op(pd, opts, backend, chunk_size=chunk, batch_invariant=True, **STATS)
    assert rel_err(out.logps.cpu(), want) <= 1e-5
    for got, ref in zip(grads, want_grads):
        assert rel_err(got.cpu(), ref) <= 1e-5
    assert_stats_match(out, p, opts, z, 1e-5)
