"""The "triton" backend of `head_logprobs`: parity with the oracle of test_ops.py.

Two tiers:
- on CUDA (skipped without a GPU): the op parity suite run through `backend="triton"`
  (values, statistics and every gradient; fp32 to ~1e-5 relative, bf16 no worse than the
  unfused bf16 computation plus a small tolerance), memory, and `auto` selection;
- on CPU without a GPU: the same kernels under Triton's interpreter (TRITON_INTERPRET=1)
  on a few small cases, so CI exercises the kernels' arithmetic too.

Everything is skipped when Triton is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedalign.ops import BackendUnavailableError, LowRank, head_logprobs
from fusedalign.ops.options import HeadOptions, resolve_chunk_rows
from tests.unit.test_ops import (
    ALL_CASES,
    CASES,
    fro_err,
    grad_inputs,
    make_problem,
    opts_of,
    rel_err,
    run_op,
    run_oracle,
)

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
REPO = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
GRAD_NAMES = ("hidden", "weight", "bias", "down", "up")


def on(p, device):
    """The problem's tensors as fresh leaves on `device` (labels and upstream too)."""
    out = {}
    for k, t in p.items():
        if t is None or k in ("labels", "g"):
            out[k] = None if t is None else t.to(device)
        else:
            out[k] = t.detach().to(device).requires_grad_()
    return out


def expected_stats(p, opts, *, every_row=False):
    """Entropy, logit mean and argmax match; 0 (False) on ignored rows, which
    `head_logprobs` never computes, unless `every_row` (a backend called directly)."""
    _, _, z = run_oracle(p, opts)
    z = z.detach()
    logq = torch.log_softmax(z / opts["temperature"], dim=-1)
    valid = p["labels"] != -100
    entropy, mean = -(logq.exp() * logq).sum(-1), z.mean(-1)
    if not every_row:
        entropy, mean = entropy.masked_fill(~valid, 0.0), mean.masked_fill(~valid, 0.0)
    return entropy, mean, (z.argmax(-1) == p["labels"]) & valid


def check_parity(p_dev, p_cpu, opts, out, grads, rtol):
    want, want_grads, _ = run_oracle(p_cpu, opts)  # fp64 truth on the same rounded inputs
    assert out.backend == "triton"
    assert out.logps.dtype == torch.float32 and out.logps.shape == want.shape
    assert rel_err(out.logps.cpu(), want) <= rtol
    for name, got, ref, leaf in zip(GRAD_NAMES, grads, want_grads, grad_inputs(p_dev)):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape, name
        assert rel_err(got.cpu(), ref) <= rtol, name


# --------------------------------------------------------------------------- CUDA


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("min_cols", [1, None], ids=["vocab_chunks", "default"])
@pytest.mark.parametrize("case", list(ALL_CASES), ids=list(ALL_CASES))
def test_cuda_values_and_grads_match_oracle(case, min_cols, monkeypatch):
    """min_cols=1: chunks over the vocabulary only, as the op runs on long vocabularies below
    ~57k rows; default: these small vocabularies are taken in row blocks whenever chunked."""
    if min_cols is not None:
        from fusedalign.ops import triton_chunks

        monkeypatch.setattr(triton_chunks, "MIN_COLS", min_cols)
    n, v, h, chunk, prob, opt = ALL_CASES[case]
    p = make_problem(n, v, h, dtype=torch.float32, **prob)
    opts = opts_of(**opt)
    pd = on(p, "cuda")
    out, grads = run_op(pd, opts, "triton", chunk_size=chunk)
    # fp32 GEMMs on another device and the kernels' fast exp: a little above CPU's 3e-6.
    check_parity(pd, p, opts, out, grads, rtol=1e-5)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "n, v, h, chunk, seed",
    [(96, 300, 64, 17, 7), (96, 300, 64, 17, 3), (1024, 128, 32, 16, 0), (512, 6000, 128, 40, 1)],
)
def test_cuda_bf16_error_no_worse_than_unfused_bf16(n, v, h, chunk, seed):
    """Cut Cross-Entropy's criterion: err(fused) <= err(naive bf16) + tol, against fp64."""
    p = make_problem(n, v, h, dtype=torch.bfloat16, bias=True, rank=4, ignore_frac=0.2,
                     logit_std=4.0, seed=seed)
    opts = opts_of(temperature=0.9, softcap=6.0, logit_scale=1.1, lr_scale=0.5)
    truth, truth_grads, _ = run_oracle(p, opts)
    naive, naive_grads, _ = run_oracle(p, opts, as_dtype=torch.bfloat16, upcast=torch.float32)
    pd = on(p, "cuda")
    out, grads = run_op(pd, opts, "triton", chunk_size=chunk)
    assert out.backend == "triton"
    tol = 1e-3
    assert fro_err(out.logps.cpu(), truth) <= fro_err(naive, truth) + tol
    for name, got, ref, nv in zip(GRAD_NAMES, grads, truth_grads, naive_grads):
        assert got.dtype == torch.bfloat16, name
        assert fro_err(got.cpu(), ref) <= fro_err(nv, ref) + tol, name


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("logit_std", [1.0, 300.0])  # 300: exp would overflow unshifted
def test_cuda_logps_nonpositive_finite_and_zero_when_ignored(logit_std):
    p = make_problem(33, 70, 8, dtype=torch.float32, ignore_frac=0.3, logit_std=logit_std)
    pd = on(p, "cuda")
    out, grads = run_op(pd, opts_of(), "triton", chunk_size=7)
    assert torch.isfinite(out.logps).all() and (out.logps <= 0).all()
    assert (out.logps[pd["labels"] == -100] == 0).all()
    assert all(torch.isfinite(g).all() for g in grads)
    # The kernel computes exp2(z * log2(e) - m) with the scale folded in: the exponent
    # carries ~0.1 ulp of |z| of absolute error, so the gradients' relative error grows
    # with the logits' size (measured on an H200: 1.3e-7 at max|z| = 6, 2.6e-6 at 187,
    # 2.2e-5 at 1869, against the torch backend's ~1e-6; scripts/triton_large_logits.py).
    # The bar: the torch backend's own fp32 error, or a quarter of an fp32 ulp of max|z|.
    want, want_grads, z = run_oracle(p, opts_of())
    naive, naive_grads = run_op(on(p, "cuda"), opts_of(), "torch", chunk_size=7)
    scale_bound = torch.finfo(torch.float32).eps * z.abs().max().item() / 4
    assert out.backend == "triton"
    assert rel_err(out.logps.cpu(), want) <= max(1e-5, 2 * rel_err(naive.logps.cpu(), want))
    for name, got, ref, base in zip(GRAD_NAMES, grads, want_grads, naive_grads):
        assert rel_err(got.cpu(), ref) <= max(1e-5, 2 * rel_err(base.cpu(), ref), scale_bound), name


@needs_cuda
@pytest.mark.gpu
def test_cuda_fp32_adapter_on_bf16_head():
    """PEFT keeps LoRA weights in fp32 over a bf16 model: G reaches them in fp32."""
    p = make_problem(200, 700, 64, dtype=torch.bfloat16, bias=True, rank=8, ignore_frac=0.2, seed=5)
    for k in ("down", "up"):
        p[k] = p[k].detach().float().requires_grad_()
    opts = opts_of(temperature=1.0, softcap=None, lr_scale=0.7)
    truth, truth_grads, _ = run_oracle(p, opts)
    naive, naive_grads = run_op(p, opts, "torch", chunk_size=13)  # chunked torch on CPU
    pd = on(p, "cuda")
    out, grads = run_op(pd, opts, "triton", chunk_size=13)
    assert fro_err(out.logps.cpu(), truth) <= fro_err(naive.logps, truth) + 1e-3
    for name, got, ref, nv, leaf in zip(GRAD_NAMES, grads, truth_grads, naive_grads,
                                        grad_inputs(pd)):
        assert got.dtype == leaf.dtype, name
        assert fro_err(got.cpu(), ref) <= fro_err(nv, ref) + 1e-3, name


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["mixed_ignored", "everything", "softcap", "random3"])
def test_cuda_stats_match_oracle(case):
    n, v, h, chunk, prob, opt = ALL_CASES[case]
    p = make_problem(n, v, h, dtype=torch.float32, **prob)
    opts = opts_of(**opt)
    want_entropy, want_mean, want_match = expected_stats(p, opts)
    pd = on(p, "cuda")
    lr = None if pd["down"] is None else LowRank(pd["down"], pd["up"], opts["lr_scale"])
    out = head_logprobs(pd["hidden"], pd["weight"], pd["labels"], pd["bias"],
                        temperature=opts["temperature"], softcap=opts["softcap"],
                        logit_scale=opts["logit_scale"], low_rank=lr, entropy=True,
                        logit_mean=True, argmax=True, chunk_size=chunk, backend="triton")
    assert not (out.entropy.requires_grad or out.logit_mean.requires_grad)
    assert rel_err(out.entropy.cpu(), want_entropy) <= 1e-5
    assert rel_err(out.logit_mean.cpu(), want_mean) <= 1e-5
    assert torch.equal(out.argmax_match.cpu(), want_match)


@needs_cuda
@pytest.mark.gpu
def test_cuda_ignored_positions_exact_zeros_even_with_nan_upstream():
    n, v, h, chunk, prob, opt = CASES["everything"]
    p = on(make_problem(n, v, h, dtype=torch.float32, **prob), "cuda")
    ignored = p["labels"] == -100
    p["g"] = torch.where(ignored, torch.nan, p["g"])
    out, grads = run_op(p, opts_of(**opt), "triton", chunk_size=chunk)
    assert torch.equal(out.logps[ignored], torch.zeros_like(out.logps[ignored]))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.count_nonzero(grads[0][ignored]) == 0


@needs_cuda
@pytest.mark.gpu
def test_cuda_only_some_inputs_require_grad_and_noncontiguous():
    p = make_problem(30, 77, 12, dtype=torch.float32, bias=True, rank=2)
    pd = on(p, "cuda")
    hidden = pd["hidden"].detach()[:, ::2]  # strided, no grad
    weight = pd["weight"].detach().t().contiguous().t()[:, ::2].requires_grad_()
    lr = LowRank(pd["down"].detach(), pd["up"], 0.5)
    out = head_logprobs(hidden, weight, pd["labels"], pd["bias"].detach(), low_rank=lr,
                        chunk_size=7, backend="triton")
    (out.logps * pd["g"].float()).sum().backward()
    ref = {k: p[k].detach() for k in ("hidden", "weight", "down", "up")}
    ref["weight"] = ref["weight"][:, ::2].clone().requires_grad_()
    ref["up"] = ref["up"].clone().requires_grad_()
    want = head_logprobs(ref["hidden"][:, ::2], ref["weight"], p["labels"], p["bias"].detach(),
                         low_rank=LowRank(ref["down"], ref["up"], 0.5), backend="torch")
    (want.logps * p["g"].float()).sum().backward()
    assert rel_err(out.logps.cpu(), want.logps) <= 1e-5
    assert rel_err(weight.grad.cpu(), ref["weight"].grad) <= 1e-5
    assert rel_err(pd["up"].grad.cpu(), ref["up"].grad) <= 1e-5
    assert pd["hidden"].grad is None and pd["down"].grad is None


@needs_cuda
@pytest.mark.gpu
def test_cuda_auto_picks_triton_except_float64():
    p = make_problem(8, 20, 4, dtype=torch.float32)
    dev = {k: None if t is None else t.detach().cuda() for k, t in p.items()}
    assert head_logprobs(dev["hidden"], dev["weight"], dev["labels"]).backend == "triton"
    bf = dev["hidden"].bfloat16(), dev["weight"].bfloat16()
    assert head_logprobs(*bf, dev["labels"]).backend == "triton"
    d64 = dev["hidden"].double(), dev["weight"].double()
    assert head_logprobs(*d64, dev["labels"]).backend == "torch-chunked"
    with pytest.raises(BackendUnavailableError, match="float64"):
        head_logprobs(*d64, dev["labels"], backend="triton")
    # CPU keeps the torch backend.
    assert head_logprobs(p["hidden"], p["weight"], p["labels"]).backend == "torch-chunked"


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("row_blocked", [False, True])
def test_cuda_peak_memory_is_chunk_plus_accumulators(row_blocked, monkeypatch):
    """Vocabulary chunks: one chunk + the fp32 grad_h accumulator (n h 4). Row blocks: one
    chunk + the fp32 grad_W accumulator (V h 4) + one block's fp32 grad_h."""
    from fusedalign.ops import triton_chunks

    n, v, h = 4096, 32000, 256
    budget = 8 * 2**20  # 65 rows of V: chunks of ~507 columns at n = 4096
    monkeypatch.setattr(triton_chunks, "MIN_COLS", 1024 if row_blocked else 1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / 16).cuda().bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen).cuda()
    g = torch.randn(n, generator=gen).cuda()
    blocks = triton_chunks.row_blocks(n, v, HeadOptions(chunk_rows=resolve_chunk_rows(
        n, v, torch.device("cuda"), memory_budget_bytes=budget)))
    assert (len(blocks) > 1) == row_blocked

    def step():
        out = head_logprobs(hidden, weight, labels, entropy=True, argmax=True,
                            memory_budget_bytes=budget, backend="triton")
        return torch.autograd.grad((out.logps * g).sum(), [hidden, weight])

    step()  # compiles, and creates cuBLAS workspaces, which stay allocated
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    gh, gw = step()
    torch.cuda.synchronize()
    returned = gh.numel() * gh.element_size() + gw.numel() * gw.element_size()
    extra = torch.cuda.max_memory_allocated() - base - returned
    if row_blocked:
        rows = max(r1 - r0 for r0, r1 in blocks)
        assert extra <= budget // 2 + v * h * 4 + rows * h * 4 + 2 * 2**20, extra
    else:
        assert extra <= budget // 2 + n * h * 4 + 2 * 2**20, extra
    assert extra < n * v * 2 // 4  # far below the bf16 logits


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["everything", "low_rank", "bias", "mixed_ignored", "random3"])
def test_cuda_row_blocks_match_oracle(case, monkeypatch):
    """Long inputs are taken in row blocks (grad_W, grad_b, grad_up summed over blocks in fp32):
    forced here on small problems by raising the narrowest chunk the op accepts."""
    from fusedalign.ops import triton_chunks

    monkeypatch.setattr(triton_chunks, "MIN_COLS", 24)
    n, v, h, chunk, prob, opt = ALL_CASES[case]
    p = make_problem(n, v, h, dtype=torch.float32, **prob)
    assert len(triton_chunks.row_blocks(n, v, HeadOptions(chunk_rows=chunk))) > 1, case
    opts = opts_of(**opt)
    pd = on(p, "cuda")
    out, grads = run_op(pd, opts, "triton", chunk_size=chunk)
    check_parity(pd, p, opts, out, grads, rtol=1e-5)


def test_row_blocks_keep_chunks_wide_on_long_inputs():
    """At V = 151,936 and the CUDA budget: one block up to ~57k rows (the regime the kernels
    were tuned in), then blocks whose chunks are >= MIN_COLS wide, covering every row once."""
    from fusedalign.ops.triton_chunks import MIN_COLS, chunk_cols, row_blocks

    v, cuda = 151_936, torch.device("cuda")
    for n in (1, 16_384, 28_672, 56_000):
        opts = HeadOptions(chunk_rows=resolve_chunk_rows(n, v, cuda))
        assert row_blocks(n, v, opts) == [(0, n)], n
    for n in (61_440, 250_000, 1_506_304):  # 8 DPO pairs at 4k, 16k, 94k tokens
        opts = HeadOptions(chunk_rows=resolve_chunk_rows(n, v, cuda))
        assert chunk_cols(n, v, opts) < MIN_COLS, n  # one block would be too narrow
        blocks = row_blocks(n, v, opts)
        assert len(blocks) > 1 and blocks[0][0] == 0 and blocks[-1][1] == n, n
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:])), n
        assert all(chunk_cols(r1 - r0, v, opts) >= MIN_COLS for r0, r1 in blocks), n
        sizes = [r1 - r0 for r0, r1 in blocks]
        assert max(sizes) - min(sizes) <= 1, n  # equal blocks, not one sliver at the end
    # A vocabulary narrower than MIN_COLS: blocks only where a chunk would not hold all of it.
    assert row_blocks(100, 50, HeadOptions(chunk_rows=100)) == [(0, 100)]
    assert len(row_blocks(100, 50, HeadOptions(chunk_rows=10))) == 10


# --------------------------------------------------------------------------- compiling


def flag_sets(names):
    """All off, all on, and each flag alone flipped either way: every constexpr branch."""
    sets = [dict.fromkeys(names, False), dict.fromkeys(names, True)]
    for name in names:
        sets.append({n: n == name for n in names})
        sets.append({n: n != name for n in names})
    return sets


def kernel_signature(fn):
    """Argument types for compiling `fn` ahead of time: bf16 logits, fp32 state, i32 sizes."""
    sig = {}
    for name in fn.arg_names:
        if name in ("labels_ptr", "amax_ptr"):
            sig[name] = "*i32"
        elif name in ("logits_ptr", "lora_ptr", "bias_ptr"):
            sig[name] = "*bf16"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        elif name.startswith("stride") or name in ("n_rows", "c0", "c_len", "first"):
            sig[name] = "i32"
        elif name.isupper() or name.startswith("BLOCK"):
            sig[name] = "constexpr"
        else:
            sig[name] = "fp32"
    return sig


@pytest.mark.parametrize("kernel", ["fwd_chunk_kernel", "bwd_chunk_kernel"])
def test_kernels_compile_for_hopper_with_every_flag(kernel):
    """Triton's front end (no GPU needed) on each constexpr branch, for sm_90.

    A branch the interpreter runs happily can still be rejected by the compiler (e.g. two
    returns of different types); CI has no GPU, so it compiles here.
    """
    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.compiler import ASTSource
    except ImportError as err:
        pytest.skip(f"this Triton's compiler internals differ: {err}")
    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("TRITON_INTERPRET is set: the kernels are not compiled")
    from fusedalign.ops import triton_kernels

    fn = getattr(triton_kernels, kernel)
    sig = kernel_signature(fn)
    flags = [n for n, t in sig.items() if t == "constexpr" and not n.startswith("BLOCK")]
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({"num_warps": 4})
    for flag_values in flag_sets([f for f in flags if f != "ACCURATE_TANH"]):
        constants = {**flag_values, "ACCURATE_TANH": True, "BLOCK_R": 16, "BLOCK_C": 256}
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v
                                               for n, v in constants.items()})
        ctx = ir.context()
        ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        src.make_ir(target, options, backend.get_codegen_implementation(options),
                    backend.get_module_map(), ctx)  # raises CompilationError on a bad branch


# --------------------------------------------------------------------------- interpreter


@pytest.mark.skipif(CUDA, reason="CUDA present: the kernels are tested compiled, above")
def test_interpreter_kernels_match_oracle():
    """The kernels under TRITON_INTERPRET=1 on CPU tensors, in a fresh process.

    The variable must be set before `triton` itself is imported (its standard library
    is decorated at import), so this cannot run in the pytest process.
    """
    run_under_interpreter("tests.unit.test_ops_triton", "interpreter_checks", "interpreter checks passed")


def run_under_interpreter(module: str, function: str, marker: str) -> None:
    """Calls module.function() in a fresh process with TRITON_INTERPRET=1; it must print `marker`."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    code = f"from {module} import {function}; {function}()"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert marker in done.stdout


def patch_interpreter():
    """Makes Triton 3.6's interpreter run our kernels as the GPU would (call after import)."""
    import numpy as np
    import triton
    from triton.runtime import interpreter

    assert triton.knobs.runtime.interpret, "set TRITON_INTERPRET=1 before importing triton"
    # Triton 3.6's interpreter turns a scalar kernel argument into a 1-element array and
    # `range(0, n, B)` calls int() on it, which NumPy >= 2.4 refuses; read element 0.
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    # Its fp32 -> bf16 cast truncates; the GPU (cvt.rn) rounds to nearest even. Round as
    # the GPU does, so that the bf16 check below holds the kernels to CUDA's tolerance.
    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def cast_rtne(self, src, dst_type):
        if src.dtype.scalar == triton.language.float32 and dst_type.scalar == triton.language.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(t.view(torch.int16).numpy().view(np.uint16),
                                            dst_type.scalar)
        return cast_impl(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_rtne
    # Its `tl.dot` multiplies bf16 blocks as their raw bits (it stores bf16 as uint16), so the
    # products are of integers near 16,000, not of the values. The GPU multiplies the bf16 values exactly and accumulates in
    # float32; widen bf16 blocks to float32 first, which gives the same products.
    create_dot = interpreter.InterpreterBuilder.create_dot

    def dot_bf16_as_values(self, a, b, d, input_precision, max_num_imprecise_acc):
        widened = [interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), triton.language.float32)
                   if x.dtype.scalar == triton.language.bfloat16 else x for x in (a, b)]
        return create_dot(self, *widened, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = dot_bf16_as_values


def interpreter_checks():
    """Run in the subprocess above: a few small cases, fp32 and bf16, all outputs, chunked
    over the vocabulary only (row blocks: `interpreter_row_block_checks`)."""
    _interpreted_parity(("everything", "vocab_prime", "all_ignored", "random4"), min_cols=1, bf16_min_cols=1,
                        bf16_blocks=1)
    print("interpreter checks passed")


@pytest.mark.skipif(CUDA, reason="CUDA present: row blocks are tested compiled, above")
def test_interpreter_row_blocks_match_oracle():
    run_under_interpreter("tests.unit.test_ops_triton", "interpreter_row_block_checks", "row block checks passed")


def interpreter_row_block_checks():
    """Run in a subprocess: the row-blocked path (forced by raising MIN_COLS), fp32 values,
    statistics and every gradient, and the bf16 criterion with grad_W summed over blocks."""
    _interpreted_parity(("everything", "low_rank", "mixed_ignored", "random3"), min_cols=24, bf16_min_cols=64,
                        bf16_blocks=3)
    print("row block checks passed")


def _interpreted_parity(cases, *, min_cols: int, bf16_min_cols: int, bf16_blocks: int) -> None:
    """fp32 parity (values, statistics, every gradient) on `cases` with MIN_COLS = min_cols,
    then the bf16 criterion on one problem taken in `bf16_blocks` row blocks."""
    patch_interpreter()
    from fusedalign.ops import triton_chunks

    triton_chunks.MIN_COLS = min_cols
    for case in cases:
        n, v, h, chunk, prob, opt = ALL_CASES[case]
        blocks = triton_chunks.row_blocks(n, v, HeadOptions(chunk_rows=resolve_chunk_rows(n, v, torch.device("cpu"), chunk)))
        assert (len(blocks) > 1) == (min_cols > 1), case  # the path under test really runs
        p = make_problem(n, v, h, dtype=torch.float32, **prob)
        opts = opts_of(**opt)
        out, grads = run_interpreted(p, opts, chunk, stats=True)
        check_parity(p, p, opts, out, grads, rtol=3e-6)
        want_entropy, want_mean, want_match = expected_stats(p, opts, every_row=True)
        assert rel_err(out.entropy, want_entropy) <= 1e-6, case
        assert rel_err(out.logit_mean, want_mean) <= 1e-6, case
        assert torch.equal(out.argmax_match, want_match), case

    triton_chunks.MIN_COLS = bf16_min_cols
    p = make_problem(48, 150, 32, dtype=torch.bfloat16, bias=True, rank=4, ignore_frac=0.2,
                     logit_std=4.0, seed=7)
    assert len(triton_chunks.row_blocks(48, 150, HeadOptions(chunk_rows=9))) == bf16_blocks
    opts = opts_of(temperature=0.9, softcap=6.0, logit_scale=1.1, lr_scale=0.5)
    truth, truth_grads, _ = run_oracle(p, opts)
    naive, naive_grads, _ = run_oracle(p, opts, as_dtype=torch.bfloat16, upcast=torch.float32)
    out, grads = run_interpreted(p, opts, chunk=9)
    tol = 1e-3
    assert fro_err(out.logps, truth) <= fro_err(naive, truth) + tol
    for name, got, ref, nv in zip(GRAD_NAMES, grads, truth_grads, naive_grads):
        assert got.dtype == torch.bfloat16, name
        assert fro_err(got, ref) <= fro_err(nv, ref) + tol, name


def run_interpreted(p, opts, chunk, stats=False):
    """The backend's run function on CPU tensors (the registry refuses CPU for "triton")."""
    from fusedalign.ops.triton_head import triton_head_logprobs

    n, v = p["hidden"].shape[0], p["weight"].shape[0]
    lr = None if p["down"] is None else LowRank(p["down"], p["up"], opts["lr_scale"])
    ho = HeadOptions(
        temperature=opts["temperature"], softcap=opts["softcap"],
        logit_scale=opts["logit_scale"], low_rank_scale=0.0 if lr is None else lr.scale,
        entropy=stats, logit_mean=stats, argmax=stats,
        chunk_rows=resolve_chunk_rows(n, v, torch.device("cpu"), chunk),
    )
    out = triton_head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"], lr, ho)
    grads = torch.autograd.grad((out.logps * p["g"].float()).sum(), grad_inputs(p))
    return out, list(grads)
