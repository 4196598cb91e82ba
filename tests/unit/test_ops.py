"""Parity, memory and validation tests of `fusedalign.ops.head_logprobs`.

The oracle is written here, independently of the library: logits -> cross_entropy
(reduction="none", ignore_index) -> -CE, differentiated by autograd. Every backend must
agree with it in value and in every gradient under a random upstream gradient.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fusedalign.ops import (
    BackendUnavailableError,
    HeadOutput,
    LowRank,
    head_logprobs,
    reference_head_logprobs,
)
from fusedalign.ops.options import resolve_chunk_rows

BACKENDS = ["torch", "reference"]


# --------------------------------------------------------------------------- oracle


def oracle_logits(h, w, b=None, lr=None, logit_scale=1.0, softcap=None, upcast=torch.float64):
    """z [N, V]: the GEMMs in the input dtype (as a model's lm_head would), then `upcast`."""
    z = F.linear(h, w, b)
    if lr is not None:
        z = z + lr.scale * F.linear(lr.down, lr.up)
    z = z.to(upcast) * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


def oracle_logps(z, labels, temperature=1.0, ignore_index=-100):
    return -F.cross_entropy(z / temperature, labels, ignore_index=ignore_index, reduction="none")


# --------------------------------------------------------------------------- problems


def make_problem(n, v, h, *, dtype=torch.float64, bias=False, rank=0, ignore_frac=0.0,
                 logit_std=3.0, seed=0):
    """Random inputs (leaf tensors requiring grad), with logits of std ~ `logit_std`."""
    gen = torch.Generator().manual_seed(seed)
    x = {
        "hidden": torch.randn(n, h, generator=gen, dtype=torch.float64),
        "weight": torch.randn(v, h, generator=gen, dtype=torch.float64) * logit_std / h**0.5,
        "bias": torch.randn(v, generator=gen, dtype=torch.float64) if bias else None,
        "down": torch.randn(n, rank, generator=gen, dtype=torch.float64) if rank else None,
        "up": torch.randn(v, rank, generator=gen, dtype=torch.float64) / rank**0.5 if rank else None,
    }
    x = {k: None if t is None else t.to(dtype).requires_grad_() for k, t in x.items()}
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignore_frac] = -100
    if ignore_frac >= 1.0:
        labels[:] = -100
    x["labels"] = labels
    x["g"] = torch.randn(n, generator=gen, dtype=torch.float64)  # upstream gradient
    return x


def grad_inputs(p):
    return [p[k] for k in ("hidden", "weight", "bias", "down", "up") if p[k] is not None]


def low_rank_of(p, scale):
    return None if p["down"] is None else LowRank(p["down"], p["up"], scale)


def run_oracle(p, opts, as_dtype=torch.float64, upcast=torch.float64):
    """Oracle values and gradients, computed on copies of the inputs cast to `as_dtype`."""
    leaves = {k: None if p[k] is None else p[k].detach().to(as_dtype).requires_grad_()
              for k in ("hidden", "weight", "bias", "down", "up")}
    lr = None if leaves["down"] is None else LowRank(leaves["down"], leaves["up"], opts["lr_scale"])
    z = oracle_logits(leaves["hidden"], leaves["weight"], leaves["bias"], lr,
                      opts["logit_scale"], opts["softcap"], upcast=upcast)
    logps = oracle_logps(z, p["labels"], opts["temperature"])
    wrt = [t for t in leaves.values() if t is not None]
    grads = torch.autograd.grad((logps * p["g"].to(logps.dtype)).sum(), wrt, allow_unused=True)
    return logps.detach(), [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, wrt)], z


def run_op(p, opts, backend, chunk_size=None, fn=head_logprobs, **extra):
    out = fn(p["hidden"], p["weight"], p["labels"], p["bias"], temperature=opts["temperature"],
             softcap=opts["softcap"], logit_scale=opts["logit_scale"],
             low_rank=low_rank_of(p, opts["lr_scale"]), chunk_size=chunk_size, backend=backend,
             **extra)
    wrt = grad_inputs(p)
    grads = torch.autograd.grad((out.logps * p["g"].float()).sum(), wrt)
    return out, list(grads)


def rel_err(a, b):
    """max |a - b| / max |b| (0 when both are exactly zero)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    return err / scale if scale > 0 else err


def opts_of(temperature=1.0, softcap=None, logit_scale=1.0, lr_scale=0.5):
    return dict(temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                lr_scale=lr_scale)


# Named cases: (N, V, H, chunk_size, problem kwargs, op options).
CASES = {
    "n_multiple_of_chunk": (24, 37, 8, 8, {}, {}),
    "n_chunk_plus_1": (9, 37, 8, 8, {}, {}),
    "n_chunk_minus_1": (7, 37, 8, 8, {}, {}),
    "one_token": (1, 50, 4, None, {}, {}),
    "chunk_of_one": (5, 11, 3, 1, {}, {}),
    "chunk_larger_than_n": (6, 29, 5, 64, {}, {}),
    "default_chunking": (40, 53, 8, None, {}, {}),
    "vocab_prime": (16, 101, 6, 5, {}, {}),
    "all_ignored": (10, 23, 4, 3, {"ignore_frac": 1.0, "bias": True, "rank": 2}, {}),
    "mixed_ignored": (20, 31, 8, 6, {"ignore_frac": 0.4}, {}),
    "temperature": (12, 40, 8, 5, {}, {"temperature": 0.7}),
    "softcap": (12, 40, 8, 5, {"logit_std": 8.0}, {"softcap": 5.0}),
    "logit_scale": (12, 40, 8, 5, {}, {"logit_scale": 0.37}),
    "bias": (12, 40, 8, 5, {"bias": True}, {}),
    "low_rank": (12, 40, 8, 5, {"rank": 3}, {"lr_scale": 2.0}),
    "everything": (
        23, 97, 8, 4, {"bias": True, "rank": 4, "ignore_frac": 0.3, "logit_std": 6.0},
        {"temperature": 1.6, "softcap": 4.0, "logit_scale": 1.3, "lr_scale": 0.25},
    ),
}


def random_cases(count, seed=1234):
    """Random shapes and options, fixed by the seed so failures reproduce."""
    rnd = random.Random(seed)
    out = {}
    for i in range(count):
        n, v, h = rnd.randint(1, 40), rnd.randint(2, 130), rnd.randint(1, 12)
        prob = {"bias": rnd.random() < 0.5, "rank": rnd.choice([0, 1, 3]),
                "ignore_frac": rnd.choice([0.0, 0.3]), "logit_std": rnd.uniform(0.5, 8.0), "seed": i}
        opts = {"temperature": rnd.choice([1.0, 0.5, 2.0]),
                "softcap": rnd.choice([None, 3.0]), "logit_scale": rnd.choice([1.0, 0.8])}
        out[f"random{i}"] = (n, v, h, rnd.choice([None, 1, rnd.randint(1, n + 1)]), prob, opts)
    return out


ALL_CASES = {**CASES, **random_cases(8)}


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", list(ALL_CASES), ids=list(ALL_CASES))
def test_values_and_grads_match_oracle(case, dtype, backend):
    n, v, h, chunk, prob, opt = ALL_CASES[case]
    p = make_problem(n, v, h, dtype=dtype, **prob)
    opts = opts_of(**opt)
    want, want_grads, _ = run_oracle(p, opts)  # fp64 truth on the same (rounded) inputs
    out, grads = run_op(p, opts, backend, chunk_size=chunk)

    # float32 out, except float64 in gives float64 out (so fp64 parity checks are exact).
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.logps.dtype == out_dtype and out.logps.shape == (n,)
    rtol = 1e-6 if dtype == torch.float64 else 3e-6
    assert rel_err(out.logps, want) <= rtol
    for name, got, ref, leaf in zip(("hidden", "weight", "bias", "down", "up"),
                                    grads, want_grads, grad_inputs(p)):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape, name
        assert rel_err(got, ref) <= rtol, name


@pytest.mark.parametrize("case", ["all_ignored", "mixed_ignored", "everything"])
def test_ignored_positions_are_exact_zeros_without_gradient(case):
    n, v, h, chunk, prob, opt = CASES[case]
    p = make_problem(n, v, h, **prob)
    # NaN upstream at ignored positions must not leak into any gradient.
    ignored = p["labels"] == -100
    p["g"] = torch.where(ignored, torch.nan, p["g"])
    out, grads = run_op(p, opts_of(**opt), "torch", chunk_size=chunk)
    assert torch.equal(out.logps[ignored], torch.zeros(int(ignored.sum())))
    for g in grads:
        assert torch.isfinite(g).all()
    if ignored.all():
        assert all(torch.count_nonzero(g) == 0 for g in grads)
    else:  # the hidden rows of ignored positions get exactly zero
        assert torch.count_nonzero(grads[0][ignored]) == 0


def fro_err(a, b):
    """||a - b|| / ||b||: a whole-tensor error, not quantised by one element's bf16 ulp."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "n, v, h, chunk, seed",
    [(96, 300, 64, 17, 7), (96, 300, 64, 17, 3), (1024, 128, 32, 16, 0)],  # last: 64 chunks
)
def test_bf16_error_no_worse_than_unfused_bf16(n, v, h, chunk, seed):
    """Cut Cross-Entropy's criterion: err(fused) <= err(naive bf16) + tol, against fp64."""
    p = make_problem(n, v, h, dtype=torch.bfloat16, bias=True, rank=4, ignore_frac=0.2,
                     logit_std=4.0, seed=seed)
    opts = opts_of(temperature=0.9, softcap=6.0, logit_scale=1.1, lr_scale=0.5)
    truth, truth_grads, _ = run_oracle(p, opts)  # fp64 on the bf16-rounded inputs
    # The naive model path: bf16 GEMMs, logits upcast to fp32 for the softmax.
    naive, naive_grads, _ = run_oracle(p, opts, as_dtype=torch.bfloat16, upcast=torch.float32)
    out, grads = run_op(p, opts, "torch", chunk_size=chunk)
    tol = 1e-3  # a quarter of bf16's epsilon; a real bug costs orders of magnitude more
    assert fro_err(out.logps, truth) <= fro_err(naive, truth) + tol
    for name, got, ref, nv in zip(("hidden", "weight", "bias", "down", "up"),
                                  grads, truth_grads, naive_grads):
        assert got.dtype == torch.bfloat16, name
        assert fro_err(got, ref) <= fro_err(nv, ref) + tol, name


# --------------------------------------------------------------------------- stats


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["mixed_ignored", "everything", "softcap", "random3"])
def test_stats_match_oracle(case, backend):
    n, v, h, chunk, prob, opt = ALL_CASES[case]
    p = make_problem(n, v, h, **prob)
    opts = opts_of(**opt)
    _, _, z = run_oracle(p, opts)
    z = z.detach()
    logq = torch.log_softmax(z / opts["temperature"], dim=-1)
    valid = p["labels"] != -100
    # Ignored rows are not computed: their statistics are 0 (False).
    want_entropy = (-(logq.exp() * logq).sum(-1)).masked_fill(~valid, 0.0)
    want_mean = z.mean(-1).masked_fill(~valid, 0.0)
    want_match = (z.argmax(-1) == p["labels"]) & valid

    out = head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"],
                        temperature=opts["temperature"], softcap=opts["softcap"],
                        logit_scale=opts["logit_scale"], low_rank=low_rank_of(p, opts["lr_scale"]),
                        entropy=True, logit_mean=True, argmax=True, chunk_size=chunk,
                        backend=backend)
    out_dtype = torch.float64 if p["hidden"].dtype == torch.float64 else torch.float32
    assert out.entropy.dtype == out.logit_mean.dtype == out_dtype
    assert out.argmax_match.dtype == torch.bool
    assert not (out.entropy.requires_grad or out.logit_mean.requires_grad)
    assert rel_err(out.entropy, want_entropy) <= 1e-6
    assert rel_err(out.logit_mean, want_mean) <= 1e-6
    assert torch.equal(out.argmax_match, want_match)
    # The case must exercise both outcomes somewhere in the suite.
    if case == "everything":
        p["labels"][:3] = z[:3].argmax(-1)
        again = head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"],
                              temperature=opts["temperature"], softcap=opts["softcap"],
                              logit_scale=opts["logit_scale"],
                              low_rank=low_rank_of(p, opts["lr_scale"]), argmax=True,
                              chunk_size=chunk, backend=backend)
        assert again.argmax_match[:3].all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_scored_row_gives_zero_statistics_and_a_connected_graph(backend):
    p = make_problem(6, 13, 4, bias=True, ignore_frac=1.0)
    out = head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"], entropy=True, logit_mean=True,
                        argmax=True, backend=backend)
    for value in (out.logps, out.entropy, out.logit_mean):
        assert value.shape == (6,) and torch.count_nonzero(value) == 0
    assert not out.argmax_match.any()
    grads = torch.autograd.grad(out.logps.sum(), grad_inputs(p))  # connected: every input gets a gradient
    assert all(g.shape == t.shape and torch.count_nonzero(g) == 0 for g, t in zip(grads, grad_inputs(p)))


def test_stats_are_none_unless_requested():
    p = make_problem(5, 9, 3)
    out = head_logprobs(p["hidden"], p["weight"], p["labels"])
    assert isinstance(out, HeadOutput)
    assert out.entropy is None and out.logit_mean is None and out.argmax_match is None


# --------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("logit_std", [1.0, 300.0])  # 300: exp would overflow unshifted
def test_logps_nonpositive_finite_and_zero_when_ignored(backend, logit_std):
    p = make_problem(33, 70, 8, dtype=torch.float32, ignore_frac=0.3, logit_std=logit_std)
    out, grads = run_op(p, opts_of(), backend, chunk_size=7)
    assert torch.isfinite(out.logps).all() and (out.logps <= 0).all()
    assert (out.logps[p["labels"] == -100] == 0).all()
    assert all(torch.isfinite(g).all() for g in grads)
    want, _, _ = run_oracle(p, opts_of())
    assert rel_err(out.logps, want) <= 1e-5


def test_backend_reported_and_auto_is_torch():
    p = make_problem(4, 6, 2)
    assert head_logprobs(p["hidden"], p["weight"], p["labels"]).backend == "torch-chunked"
    assert head_logprobs(p["hidden"], p["weight"], p["labels"], backend="torch").backend == "torch-chunked"
    assert reference_head_logprobs(p["hidden"], p["weight"], p["labels"]).backend == "reference"


def test_reference_wrapper_forwards_every_argument():
    p = make_problem(9, 23, 5, bias=True, rank=2, ignore_frac=0.3)
    kw = dict(temperature=0.8, softcap=2.0, logit_scale=1.2, low_rank=low_rank_of(p, 0.7), entropy=True,
              logit_mean=True, argmax=True)
    want = head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"], backend="reference", **kw)
    for backend in ("reference", "auto"):
        got = reference_head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"], backend=backend, **kw)
        assert got.backend == "reference"
        for a, b in zip(got[:4], want[:4]):
            assert torch.equal(a, b)
    with pytest.raises(TypeError, match="no_such_option"):
        reference_head_logprobs(p["hidden"], p["weight"], p["labels"], no_such_option=1)


def test_only_some_inputs_require_grad():
    p = make_problem(10, 17, 4, bias=True, rank=2)
    for k in ("hidden", "bias", "down"):
        p[k] = p[k].detach()
    lr = low_rank_of(p, 0.5)
    out = head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"], low_rank=lr, chunk_size=3)
    (out.logps * p["g"].float()).sum().backward()
    _, want_grads, _ = run_oracle(p, opts_of())
    assert p["hidden"].grad is None and p["down"].grad is None
    assert rel_err(p["weight"].grad, want_grads[1]) <= 1e-6
    assert rel_err(p["up"].grad, want_grads[4]) <= 1e-6
    with torch.no_grad():  # nothing requires grad: a plain forward
        plain = head_logprobs(p["hidden"].detach(), p["weight"].detach(), p["labels"])
    assert not plain.logps.requires_grad


def test_lora_gradient_reaches_lora_a_and_input():
    torch.manual_seed(0)
    n, h, v, r = 12, 6, 25, 3
    x = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(h, v, bias=False, dtype=torch.float64)
    lora_a = torch.nn.Linear(h, r, bias=False, dtype=torch.float64)
    lora_b = torch.nn.Linear(r, v, bias=False, dtype=torch.float64)
    labels = torch.randint(0, v, (n,))
    g = torch.randn(n, dtype=torch.float64)

    def grads(fused):
        for t in (x, head.weight, lora_a.weight, lora_b.weight):
            t.grad = None
        if fused:
            lr = LowRank(lora_a(x), lora_b.weight, 2.0)
            logps = head_logprobs(x, head.weight, labels, low_rank=lr, chunk_size=5).logps.double()
        else:
            logps = oracle_logps(head(x) + 2.0 * lora_b(lora_a(x)), labels)
        (logps * g).sum().backward()
        return [t.grad.clone() for t in (x, head.weight, lora_a.weight, lora_b.weight)]

    for got, want in zip(grads(True), grads(False)):
        assert rel_err(got, want) <= 1e-6


def test_noncontiguous_inputs_and_int32_labels():
    p = make_problem(14, 19, 10, bias=True)
    hidden = p["hidden"].detach()[:, ::2].requires_grad_()  # [14, 5], strided
    weight = p["weight"].detach().t().contiguous().t()[:, :5]  # column-major view of [19, 5]
    weight.requires_grad_()
    labels = p["labels"].to(torch.int32)
    out = head_logprobs(hidden, weight, labels, p["bias"], chunk_size=4)
    z = oracle_logits(hidden, weight, p["bias"])
    want = oracle_logps(z, labels.long())
    assert rel_err(out.logps, want) <= 1e-6
    got_grads = torch.autograd.grad(out.logps.sum(), [hidden, weight])
    want_grads = torch.autograd.grad(want.sum(), [hidden, weight])
    for got, ref in zip(got_grads, want_grads):
        assert got.shape == ref.shape and rel_err(got, ref) <= 1e-6
    # A column-major hidden: its gradient buffer must not inherit that layout per chunk.
    col_major = hidden.detach().t().contiguous().t().requires_grad_()
    out = head_logprobs(col_major, weight, labels, p["bias"], chunk_size=4)
    (g,) = torch.autograd.grad(out.logps.sum(), [col_major])
    assert rel_err(g, want_grads[0]) <= 1e-6


def test_empty_batch():
    p = make_problem(0, 9, 3)
    out = head_logprobs(p["hidden"], p["weight"], p["labels"], entropy=True)
    assert out.logps.shape == (0,) and out.entropy.shape == (0,)
    out.logps.sum().backward()
    assert torch.count_nonzero(p["weight"].grad) == 0


def test_autocast_matches_unfused_autocast():
    """Under CPU autocast the op casts like lm_head would and grads reach fp32 weights."""
    p = make_problem(24, 60, 16, dtype=torch.float32, bias=True, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"], chunk_size=5)
        z = F.linear(p["hidden"], p["weight"], p["bias"])
    assert z.dtype == torch.bfloat16
    naive = oracle_logps(z.double(), p["labels"])
    assert rel_err(out.logps, naive) <= 1e-2
    out.logps.sum().backward()
    assert p["weight"].grad.dtype == torch.float32 and p["bias"].grad.dtype == torch.float32


# --------------------------------------------------------------------------- memory


class NumelRecorder(TorchDispatchMode):
    """Records the largest tensor output by any op, and every op's name."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def record_fwd_bwd(backend):
    n, v, h = 4096, 32000, 16
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / 4).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::5] = -100
    fwd, bwd = NumelRecorder(), NumelRecorder()
    with fwd:
        out = head_logprobs(hidden, weight, labels, entropy=True, logit_mean=True, argmax=True,
                            backend=backend)
        loss = (out.logps * torch.randn(n, generator=gen)).sum()
    with bwd:
        loss.backward()
    # Ignored rows are never computed, so the unfused logits are [scored rows, V].
    return int((labels != -100).sum()) * v, fwd, bwd


def test_no_tensor_of_half_the_logits_is_ever_allocated():
    nv, fwd, bwd = record_fwd_bwd("torch")
    assert "mm" in bwd.ops, "the recorder must see the backward's ops, or the test proves nothing"
    assert fwd.max_numel < nv // 2, fwd.max_numel
    assert bwd.max_numel < nv // 2, bwd.max_numel


def test_memory_recorder_does_see_the_unfused_logits():
    nv, fwd, bwd = record_fwd_bwd("reference")
    assert fwd.max_numel >= nv and bwd.max_numel >= nv


def test_default_chunks_stay_below_half_the_batch():
    for device in ("cpu", "cuda"):  # a device object needs no GPU
        rows = resolve_chunk_rows(4096, 32000, torch.device(device))
        assert 1 <= rows < 2048, (device, rows)
        rows = resolve_chunk_rows(16384, 151936, torch.device(device))
        assert 1 <= rows < 8192, (device, rows)
    assert resolve_chunk_rows(10, 50, torch.device("cpu")) == 10  # small: one chunk
    assert resolve_chunk_rows(100, 50, torch.device("cpu"), chunk_size=7) == 7
    assert resolve_chunk_rows(100, 50, torch.device("cpu"), memory_budget_bytes=50 * 4 * 3) == 3


# --------------------------------------------------------------------------- errors


def _bad(**changes):
    p = make_problem(6, 11, 4)
    kwargs = dict(hidden=p["hidden"], weight=p["weight"], labels=p["labels"])
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (_bad(hidden=torch.randn(2, 3, 4)), ValueError, r"hidden must be \[N, H\]"),
        (_bad(weight=torch.randn(11, 5)), ValueError, r"weight must be \[V, H\] = \[V, 4\]"),
        (_bad(labels=torch.zeros(5, dtype=torch.long)), ValueError, r"labels must be \[N\] = \[6\]"),
        (_bad(labels=torch.zeros(6)), TypeError, r"labels must be an integer tensor"),
        (_bad(labels=torch.full((6,), 11)), ValueError, r"labels\[0\] = 11"),
        (_bad(bias=torch.zeros(10, dtype=torch.float64)), ValueError, r"bias must be None or \[V\] = \[11\]"),
        (_bad(weight=torch.randn(11, 4)), TypeError, r"weight has dtype torch.float32"),
        (_bad(low_rank=LowRank(torch.zeros(5, 2), torch.zeros(11, 2), 1.0)), ValueError,
         r"low_rank.down must be \[N, r\] = \[6, r\]"),
        (_bad(low_rank=LowRank(torch.zeros(6, 2), torch.zeros(11, 3), 1.0)), ValueError,
         r"low_rank.up must be \[V, r\] = \[11, 2\]"),
        (_bad(low_rank=(torch.zeros(6, 2), torch.zeros(11, 2), 1.0)), TypeError, r"LowRank"),
        (_bad(temperature=0.0), ValueError, r"temperature must be > 0"),
        (_bad(softcap=float("inf")), ValueError, r"softcap must be a finite"),
        (_bad(chunk_size=0), ValueError, r"chunk_size must be a positive int"),
        (_bad(memory_budget_bytes=-1), ValueError, r"memory_budget_bytes must be a positive int"),
        (_bad(backend="nope"), ValueError, r"unknown backend 'nope'"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        head_logprobs(**kwargs)


def test_unavailable_backend_is_an_error_not_a_fallback():
    # CPU tensors: a Triton backend can never run them, whether or not its module exists.
    with pytest.raises(BackendUnavailableError, match="triton"):
        head_logprobs(**_bad(backend="triton"))
    with pytest.raises(ValueError, match="reference"):
        reference_head_logprobs(**_bad(backend="torch"))


def test_ignored_rows_are_never_computed():
    """The backend sees only the scored rows: a head over 1 scored row of 64 costs 1 x V."""
    n, v, h = 64, 5000, 8
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = torch.randn(v, h, generator=gen).requires_grad_()
    labels = torch.full((n,), -100)
    labels[17] = 3
    rec = NumelRecorder()
    with rec:
        out = head_logprobs(hidden, weight, labels, entropy=True, backend="reference")
        out.logps.sum().backward()
    # The largest tensor is the weight's gradient (V x 8); 64 x V logits would be 8x it.
    assert rec.max_numel <= v * h, rec.max_numel
    assert out.logps.shape == out.entropy.shape == (n,)
    assert out.logps[17] != 0 and out.entropy[17] > 0
    assert (out.logps[labels == -100] == 0).all() and (out.entropy[labels == -100] == 0).all()
    assert (hidden.grad[labels == -100] == 0).all() and hidden.grad[17].abs().sum() > 0
