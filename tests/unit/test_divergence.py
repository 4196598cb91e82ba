"""ops.divergence_head: values and every gradient against the unfused generalised JSD, memory, the teacher."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fusedalign.ops import LowRank
from fusedalign.ops.divergence_api import divergence_head, generalised_jsd
from tests.live_memory import LiveBytes
from tests.unit.test_ops import NumelRecorder

BETAS = [0.0, 0.3, 0.5, 1.0]


def trl_jsd(student_logits, teacher_logits, beta, temperature):
    """TRL 1.16's per-token formula, written from its description (F.kl_div with log targets)."""
    s = F.log_softmax(student_logits / temperature, -1)
    t = F.log_softmax(teacher_logits / temperature, -1)
    if beta == 0.0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if beta == 1.0:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    b = torch.tensor(beta, dtype=s.dtype)
    m = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
    return b * F.kl_div(m, t, reduction="none", log_target=True).sum(-1) + (1 - b) * F.kl_div(
        m, s, reduction="none", log_target=True).sum(-1)


def _inputs(n=13, h=8, ht=6, v=37, vt=None, seed=0, dtype=torch.float64, bias=True, lora=False, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    vt = v if vt is None else vt
    t = dict(hidden=r(n, h).requires_grad_(), weight=(scale * r(v, h) / math.sqrt(h)).requires_grad_(),
             teacher_hidden=r(n, ht), teacher_weight=(scale * r(vt, ht) / math.sqrt(ht)).requires_grad_())
    t["bias"] = r(v).requires_grad_() if bias else None
    t["teacher_bias"] = r(vt) if bias else None
    t["low_rank"] = LowRank(r(n, 3).requires_grad_(), r(v, 3).requires_grad_(), 0.5) if lora else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[1, 5, 6]] = -100
    return t, labels


def _run(t, labels, **kw):
    out = divergence_head(t["hidden"], t["weight"], labels, t["teacher_hidden"], t["teacher_weight"], t["bias"],
                          t["teacher_bias"], low_rank=t["low_rank"], **kw)
    wrt = [x for x in (t["hidden"], t["weight"], t["bias"]) if x is not None]
    if t["low_rank"] is not None:
        wrt += [t["low_rank"].down, t["low_rank"].up]
    upstream = torch.linspace(-1.0, 2.0, labels.shape[0], dtype=out.divergence.dtype)  # any per-token gradient
    grads = torch.autograd.grad((out.divergence * upstream).sum(), wrt)
    return out, grads


CASES = [
    dict(),
    dict(temperature=0.7),
    dict(temperature=2.0, teacher_temperature=0.5),
    dict(softcap=3.0, teacher_softcap=2.5, logit_scale=1.5, teacher_logit_scale=0.8),
    # Post-processing and temperature together: the order (scale, cap, then / T) matters here.
    dict(softcap=3.0, teacher_softcap=2.5, logit_scale=1.5, teacher_logit_scale=0.8, temperature=0.7),
]


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize(("chunks", "lora"), [(dict(), False), (dict(chunk_size=4), True),
                                              (dict(chunk_size=3, vocab_chunk_size=10), True)])
def test_values_and_gradients_match_unfused_float64(beta, case, chunks, lora):
    t, labels = _inputs(lora=lora, seed=case)
    fused, fused_grads = _run(t, labels, beta=beta, **CASES[case], **chunks)
    ref, ref_grads = _run(t, labels, beta=beta, backend="reference", **CASES[case])
    assert fused.backend == "torch-chunked" and ref.backend == "reference"
    torch.testing.assert_close(fused.divergence, ref.divergence, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fused.entropy, ref.entropy, rtol=1e-10, atol=1e-12)
    assert len(fused_grads) == (5 if lora else 3)
    for got, want in zip(fused_grads, ref_grads):
        assert want.abs().max() > 0  # the comparison is not between zeros
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert (fused.divergence[labels != -100] > 0).all() and (fused.divergence[labels == -100] == 0).all()


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_reference_is_trls_formula(beta, temperature):
    g = torch.Generator().manual_seed(3)
    zs = torch.randn(9, 41, generator=g, dtype=torch.float64)
    zt = 3 * torch.randn(9, 41, generator=g, dtype=torch.float64)
    d, entropy = generalised_jsd(zs, zt, beta, temperature=temperature)
    torch.testing.assert_close(d, trl_jsd(zs, zt, beta, temperature), rtol=1e-12, atol=1e-14)
    s = F.log_softmax(zs / temperature, -1)
    torch.testing.assert_close(entropy, -(s.exp() * s).sum(-1))


def trl_transform(z, logit_scale, softcap):
    """TRL 1.16's `_torch_transform` before the temperature (kernels/chunked_logprob.py): scale, then cap."""
    z = z * logit_scale
    return softcap * torch.tanh(z / softcap)


@pytest.mark.parametrize("beta", BETAS)
def test_scaled_soft_capped_heads_at_a_temperature_are_trls_formula(beta):
    """Both backends, from the raw heads: TRL's divergence of cap tanh(scale a / cap) / T for each model
    (its order: the scale, the soft-cap, then the temperature), and the student's entropy there."""
    post = dict(softcap=3.0, teacher_softcap=2.5, logit_scale=1.5, teacher_logit_scale=0.8)
    t, labels = _inputs(seed=5, scale=4.0)
    a = t["hidden"] @ t["weight"].t() + t["bias"]
    at = t["teacher_hidden"] @ t["teacher_weight"].t() + t["teacher_bias"]
    zs, zt = trl_transform(a, 1.5, 3.0), trl_transform(at, 0.8, 2.5)
    assert (zs.abs() > 2.0).any() and (zt.abs() > 1.5).any()  # the caps bend the logits
    want = trl_jsd(zs, zt, beta, 0.7).detach()
    s = F.log_softmax(zs / 0.7, -1).detach()
    keep = labels != -100
    for backend in ("torch", "reference"):
        out = divergence_head(t["hidden"], t["weight"], labels, t["teacher_hidden"], t["teacher_weight"], t["bias"],
                              t["teacher_bias"], beta=beta, temperature=0.7, backend=backend, **post)
        torch.testing.assert_close(out.divergence[keep], want[keep], rtol=1e-10, atol=1e-12, msg=backend)
        torch.testing.assert_close(out.entropy[keep], -(s.exp() * s).sum(-1)[keep], msg=backend)
        assert (out.divergence[~keep] == 0).all()


def test_a_custom_ignore_index_is_the_one_left_out():
    """ignore_index=7: the tokens labelled 7 give exactly 0 and no gradient, and those labelled -100
    (only an id here) are scored like any other: the rest equals the reference with every token scored."""
    t, labels = _inputs(seed=9)
    labels[labels == 7] = 8
    labels[[0, 4, 11]] = 7
    ignored = labels == 7
    assert (labels == -100).sum() == 3
    every = torch.zeros_like(labels)  # no token ignored
    for chunks in (dict(), dict(chunk_size=4, vocab_chunk_size=10)):
        out, grads = _run(t, labels, beta=0.5, ignore_index=7, **chunks)
        ref = divergence_head(t["hidden"], t["weight"], every, t["teacher_hidden"], t["teacher_weight"], t["bias"],
                              t["teacher_bias"], beta=0.5, backend="reference")
        assert (out.divergence[ignored] == 0).all() and (out.divergence[~ignored] > 0).all()
        torch.testing.assert_close(out.divergence[~ignored], ref.divergence[~ignored], rtol=1e-10, atol=1e-12)
        upstream = torch.linspace(-1.0, 2.0, labels.shape[0], dtype=ref.divergence.dtype).masked_fill(ignored, 0.0)
        want = torch.autograd.grad((ref.divergence * upstream).sum(), [t["hidden"], t["weight"], t["bias"]])
        for got, w in zip(grads, want):
            torch.testing.assert_close(got, w, rtol=1e-9, atol=1e-12)
        assert (grads[0][ignored] == 0).all() and (grads[0][labels == -100].abs().sum(-1) > 0).all()


def test_endpoints_are_the_two_kls():
    g = torch.Generator().manual_seed(4)
    zs, zt = torch.randn(5, 23, generator=g, dtype=torch.float64), torch.randn(5, 23, generator=g, dtype=torch.float64)
    p, q = zs.softmax(-1), zt.softmax(-1)
    forward = (q * (q.log() - p.log())).sum(-1)
    reverse = (p * (p.log() - q.log())).sum(-1)
    torch.testing.assert_close(generalised_jsd(zs, zt, 0.0)[0], forward)
    torch.testing.assert_close(generalised_jsd(zs, zt, 1.0)[0], reverse)
    # beta = 0.5: the symmetric Jensen-Shannon divergence, bounded by log 2.
    m = (p + q) / 2
    jsd = 0.5 * (q * (q.log() - m.log())).sum(-1) + 0.5 * (p * (p.log() - m.log())).sum(-1)
    torch.testing.assert_close(generalised_jsd(zs, zt, 0.5)[0], jsd)
    assert (jsd < math.log(2)).all()


@pytest.mark.parametrize("beta", [0.3, 1.0])
@pytest.mark.parametrize("chunks", [dict(), dict(chunk_size=4, vocab_chunk_size=8)])
def test_larger_teacher_vocabulary_is_minus_infinity_for_the_student(beta, chunks):
    t, labels = _inputs(v=37, vt=45, seed=7)
    fused, fused_grads = _run(t, labels, beta=beta, **chunks)
    ref, ref_grads = _run(t, labels, beta=beta, backend="reference")
    torch.testing.assert_close(fused.divergence, ref.divergence, rtol=1e-10, atol=1e-12)
    for got, want in zip(fused_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert torch.isfinite(fused.divergence).all()
    # By hand: the student padded with -inf logits, TRL's formula with 0 log 0 = 0.
    zs = t["hidden"] @ t["weight"].t() + t["bias"]
    zt = t["teacher_hidden"] @ t["teacher_weight"].t() + t["teacher_bias"]
    p = torch.cat([zs.softmax(-1), zs.new_zeros(zs.shape[0], 8)], -1)
    q, s, tl = zt.softmax(-1), F.pad(zs.log_softmax(-1), (0, 8), value=-1e300), zt.log_softmax(-1)
    if beta == 1.0:
        want = (p * (s - tl)).sum(-1)
    else:
        log_m = ((1 - beta) * p + beta * q).log()
        want = beta * (q * (tl - log_m)).sum(-1) + (1 - beta) * (p * (s - log_m)).nan_to_num().sum(-1)
    keep = labels != -100
    torch.testing.assert_close(fused.divergence[keep], want.detach()[keep], rtol=1e-10, atol=1e-12)
    # Not what padding the student with zero logits (Liger's choice) would give.
    wrong = generalised_jsd(F.pad(zs, (0, 8), value=0.0), zt, beta)[0]
    assert (wrong[keep] - fused.divergence[keep]).abs().min() > 1e-3


def test_vocabularies_that_cannot_be_compared_are_refused():
    t, labels = _inputs(v=37, vt=45)
    with pytest.raises(ValueError, match=r"larger than the student's \(37\) and beta=0"):
        _run(t, labels, beta=0.0)
    t, labels = _inputs(v=37, vt=30)
    with pytest.raises(ValueError, match=r"teacher's vocabulary \(30\) is smaller than the student's \(37\)"):
        _run(t, labels, beta=0.5)
    t, labels = _inputs()
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        _run(t, labels, beta=1.5)
    t["teacher_hidden"] = t["teacher_hidden"][:-1]
    with pytest.raises(ValueError, match=r"teacher_hidden must be \[N, Ht\] with the student's N = 13 tokens"):
        _run(t, labels, beta=0.5)


def test_the_teacher_gets_no_gradient():
    t, labels = _inputs()
    t["teacher_hidden"].requires_grad_()
    t["teacher_bias"].requires_grad_()
    out = divergence_head(t["hidden"], t["weight"], labels, t["teacher_hidden"], t["teacher_weight"], t["bias"],
                          t["teacher_bias"], beta=0.5)
    out.divergence.sum().backward()
    assert t["hidden"].grad is not None and t["weight"].grad is not None
    assert t["teacher_hidden"].grad is None and t["teacher_weight"].grad is None and t["teacher_bias"].grad is None


def test_no_scored_token_gives_zeros_and_a_connected_graph():
    t, labels = _inputs()
    labels[:] = -100
    out = divergence_head(t["hidden"], t["weight"], labels, t["teacher_hidden"], t["teacher_weight"], beta=0.5)
    assert (out.divergence == 0).all() and out.divergence.requires_grad
    out.divergence.sum().backward()
    assert (t["weight"].grad == 0).all()


def test_float32_error_no_worse_than_unfused_float32():
    """Cut Cross-Entropy's criterion: against a float64 truth, the fused float32 error is within a small
    factor of the unfused float32 error (the op sums over the vocabulary in another order, and forms its
    gradient as p (g - E_p[g]) where autograd chains log_softmax's backward)."""
    t64, labels = _inputs(n=40, v=300, scale=8.0)

    def as32():
        t = {k: (None if v is None else v.detach().float().requires_grad_(v.requires_grad)) for k, v in t64.items()
             if k != "low_rank"}
        return {**t, "low_rank": None}

    truth, truth_grads = _run(t64, labels, beta=0.5, backend="reference")
    got, got_grads = _run(as32(), labels, beta=0.5, chunk_size=7, vocab_chunk_size=64)
    naive, naive_grads = _run(as32(), labels, beta=0.5, backend="reference")
    assert got.divergence.dtype == torch.float32
    err = lambda a, b: float((a.detach().double() - b.detach()).abs().max())  # noqa: E731
    assert err(got.divergence, truth.divergence) <= 2 * err(naive.divergence, truth.divergence) + 1e-8
    for g, n, w in zip(got_grads, naive_grads, truth_grads):
        assert err(g, w) <= 3 * err(n, w) + 1e-8 * float(w.abs().max()), (err(g, w), err(n, w))


@pytest.mark.parametrize("vocab_chunk_size", [None, 1000])
def test_no_tensor_of_half_the_logits_is_alive(vocab_chunk_size):
    n, v, h = 192, 3000, 16
    t, labels = _inputs(n=n, h=h, ht=24, v=v, dtype=torch.float32, lora=True)
    fwd, bwd = NumelRecorder(), NumelRecorder()
    with fwd:
        out = divergence_head(t["hidden"], t["weight"], labels, t["teacher_hidden"], t["teacher_weight"], t["bias"],
                              t["teacher_bias"], low_rank=t["low_rank"], beta=0.5, vocab_chunk_size=vocab_chunk_size,
                              memory_budget_bytes=4 * 32 * v)
        loss = out.divergence.sum()
    with bwd:
        loss.backward()
    assert "mm" in bwd.ops and "mm" in fwd.ops  # the recorders saw the GEMMs: the bound is not vacuous
    scored_nv = int((labels != -100).sum()) * v
    assert fwd.max_numel < scored_nv // 2 and bwd.max_numel < scored_nv // 2, (fwd.max_numel, bwd.max_numel)
    # The same recorder sees the unfused path's full logits.
    ref = NumelRecorder()
    with ref:
        divergence_head(t["hidden"], t["weight"], labels, t["teacher_hidden"], t["teacher_weight"], beta=0.5,
                        backend="reference")
    assert ref.max_numel >= scored_nv


def test_no_tensor_of_half_the_logits_is_created_through_the_models():
    """`token_divergence(fused=True)` on tiny-qwen2 (student) and tiny-llama (teacher), forward and
    backward: no op creates a tensor of half the scored tokens' logits (0.5 N V), so neither model's
    head nor `logits_to_keep` materialises logits before the fused op; the unfused path does. The op's
    blocks are held to 32 rows (the default budget would give a tiny batch one block of all its rows)."""
    from fusedalign.distill_head import token_divergence
    from fusedalign.models import load_model

    torch.manual_seed(0)
    student, teacher = load_model("builtin:tiny-qwen2"), load_model("builtin:tiny-llama")
    v = student.config.vocab_size
    assert teacher.config.vocab_size == v
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, v, (4, 48), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # a right-padded row
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[0, :6] = -100  # an unscored prompt
    labels[1, -6:] = -100
    inputs = {"input_ids": ids, "attention_mask": mask}
    bound = int((labels != -100).sum()) * v // 2
    # The bound must be above every weight (and so its gradient) for the test to see the logits alone.
    assert max(p.numel() for m in (student, teacher) for p in m.parameters()) < bound
    fwd, bwd = NumelRecorder(), NumelRecorder()
    with fwd:
        out = token_divergence(student, teacher, inputs, labels, fused=True, beta=0.5, memory_budget_bytes=4 * 32 * v)
        loss = out.divergence.sum()
    with bwd:
        loss.backward()
    assert {"mm", "bmm"} & fwd.ops and "mm" in bwd.ops  # the recorders saw the GEMMs: the bound is not vacuous
    assert student.lm_head.weight.grad.abs().sum() > 0 and float(loss.detach()) > 0
    assert fwd.max_numel < bound and bwd.max_numel < bound, (fwd.max_numel, bwd.max_numel, bound)
    # The same recorder sees the unfused path's logits.
    student.zero_grad()
    ref = NumelRecorder()
    with ref:
        token_divergence(student, teacher, inputs, labels, fused=False, beta=0.5).divergence.sum().backward()
    assert ref.max_numel >= 2 * bound


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("case", ["plain", "softcap", "wider_teacher"])
def test_working_memory_is_a_few_blocks(beta, case):
    """The op's working memory, forward and backward, is a fixed few [rows, V] blocks of the
    compute dtype: both models' log-probs and one more (the mixture's log for 0 < beta < 1, the
    student's tanh with a softcap), whatever the number of tokens; the gradients' accumulators and
    the scored rows' copies come on top. Counted on every tensor the op creates (LiveBytes)."""
    if beta == 0.0 and case == "wider_teacher":
        pytest.skip("beta = 0 refuses a teacher vocabulary the student lacks")
    n, v, rows = 256, 600, 32
    vt = 700 if case == "wider_teacher" else v
    softcap = dict(softcap=3.0, teacher_softcap=2.5) if case == "softcap" else {}
    t, labels = _inputs(n=n, h=16, ht=24, v=v, vt=vt, dtype=torch.float32, lora=True)
    inputs = [t["hidden"], t["weight"], t["bias"], t["teacher_hidden"], t["teacher_weight"], t["teacher_bias"],
              t["low_rank"].down, t["low_rank"].up]
    fwd, bwd = LiveBytes(inputs), LiveBytes(inputs)
    with fwd:
        out = divergence_head(t["hidden"], t["weight"], labels, t["teacher_hidden"], t["teacher_weight"], t["bias"],
                              t["teacher_bias"], low_rank=t["low_rank"], beta=beta, chunk_size=rows, **softcap)
        loss = out.divergence.sum()
    with bwd:
        loss.backward()
    assert "mm" in fwd.ops and "mm" in bwd.ops  # the recorders saw the GEMMs: the bound is not vacuous
    block = rows * vt * 4
    blocks = 3 + (0.0 < beta < 1.0) + bool(softcap)
    rows_copies = 4 * n * (16 + 24 + 3) + 64 * n  # hidden, teacher hidden, LoRA down of the scored rows; [n] sums
    grads = sum(4 * x.numel() for x in inputs if x.requires_grad)
    assert fwd.peak <= (blocks + 0.25) * block + rows_copies, (fwd.peak / block, blocks)
    assert bwd.peak <= (blocks + 0.25) * block + rows_copies + grads, ((bwd.peak - grads) / block, blocks)


def _bf16_errors(device: str, n: int, h: int, ht: int, v: int, beta: float):
    """Largest errors against a float64 truth of (fused bf16, unfused bf16): values and student gradients."""
    g = torch.Generator().manual_seed(11)
    truth = dict(hidden=torch.randn(n, h, generator=g, dtype=torch.float64),
                 weight=2 * torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h),
                 teacher_hidden=torch.randn(n, ht, generator=g, dtype=torch.float64),
                 teacher_weight=3 * torch.randn(v, ht, generator=g, dtype=torch.float64) / math.sqrt(ht))
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    labels[::7] = -100

    def run(dtype, backend):
        t = {k: x.detach().to(device=device, dtype=dtype).requires_grad_(k in ("hidden", "weight"))
             for k, x in truth.items()}
        out = divergence_head(t["hidden"], t["weight"], labels, t["teacher_hidden"], t["teacher_weight"], beta=beta,
                              backend=backend)
        out.divergence.sum().backward()
        return [out.divergence.double(), t["hidden"].grad.double(), t["weight"].grad.double()]

    want = run(torch.float64, "reference")
    err = lambda got: [float((a - b).detach().abs().max()) for a, b in zip(got, want)]  # noqa: E731
    return err(run(torch.bfloat16, "torch")), err(run(torch.bfloat16, "reference"))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bfloat16_error_no_worse_than_unfused_bfloat16(beta):
    fused, unfused = _bf16_errors("cpu", n=96, h=32, ht=48, v=2000, beta=beta)
    for got, naive in zip(fused, unfused):
        assert got <= 2 * naive + 1e-6, (fused, unfused)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_cuda_bfloat16_qwen_shapes_no_worse_than_unfused(beta):
    """A Qwen2.5-0.5B-shaped student head (H 896) against a 1.5B-shaped teacher head (H 1536), V 151,936."""
    fused, unfused = _bf16_errors("cuda", n=1024, h=896, ht=1536, v=151936, beta=beta)
    for got, naive in zip(fused, unfused):
        assert got <= 2 * naive + 1e-6, (fused, unfused)
