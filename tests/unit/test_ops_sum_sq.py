"""The head op's `log_sum_sq_probs` statistic (WPO's weights): log sum_v p_v^2, p = softmax(z / T).

Against a direct float64 computation from the full logits (temperature, soft-capping, bias,
logit scale, LoRA, ignored rows), in every layout of the chunked backend; and the dispatch: the
Triton head does not compute it, so "auto" runs the chunked torch backend when it is asked for,
and a backend named explicitly that lacks it is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusedalign.head import logprobs_from_logits
from fusedalign.ops import BackendUnavailableError, HeadOutput, SequenceLoss, head_logprobs, registry
from tests.unit.test_ops import ALL_CASES, grad_inputs, low_rank_of, make_problem, opts_of, rel_err, run_oracle

BACKENDS = ["torch", "reference"]


def _want(z, labels, temperature):
    """[N] float64: log sum_v softmax(z / T)_v^2 written out, 0 on ignored rows."""
    p = torch.softmax(z.double() / temperature, dim=-1)
    return torch.log((p * p).sum(-1)).masked_fill(labels == -100, 0.0)


def _call(p, opts, backend, chunk, **extra):
    return head_logprobs(p["hidden"], p["weight"], p["labels"], p["bias"], temperature=opts["temperature"],
                         softcap=opts["softcap"], logit_scale=opts["logit_scale"],
                         low_rank=low_rank_of(p, opts["lr_scale"]), chunk_size=chunk, backend=backend, **extra)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", ["mixed_ignored", "temperature", "softcap", "bias", "low_rank", "everything",
                                  "all_ignored", "random3", "random5"])
def test_log_sum_sq_probs_matches_the_full_logits(case, dtype, backend):
    n, v, h, chunk, prob, opt = ALL_CASES[case]
    p = make_problem(n, v, h, dtype=dtype, **prob)
    opts = opts_of(**opt)
    _, _, z = run_oracle(p, opts)  # float64 logits of the same inputs
    want = _want(z.detach(), p["labels"], opts["temperature"])
    out = _call(p, opts, backend, chunk, log_sum_sq_probs=True)
    assert out.log_sum_sq_probs.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert out.log_sum_sq_probs.shape == (n,) and not out.log_sum_sq_probs.requires_grad
    assert rel_err(out.log_sum_sq_probs, want) <= (1e-12 if dtype == torch.float64 else 2e-6)
    assert (out.log_sum_sq_probs[p["labels"] == -100] == 0).all()
    assert (out.log_sum_sq_probs <= 0).all()  # sum p^2 <= 1
    if case == "everything":  # a real mix of scored and ignored rows, and sharp vs flat rows
        assert 0 < int((p["labels"] == -100).sum()) < n and want.std() > 0.05


@pytest.mark.parametrize("invariant", [False, True], ids=["chunked", "batch_invariant"])
def test_with_other_statistics_and_gradients_nothing_else_changes(invariant):
    n, v, h, chunk, prob, opt = ALL_CASES["everything"]
    p = make_problem(n, v, h, dtype=torch.float32, **prob)
    opts = opts_of(**opt)
    stats = dict(entropy=True, logit_mean=True, argmax=True, batch_invariant=invariant)
    plain = _call(p, opts, "torch", chunk, **stats)
    plain_grads = torch.autograd.grad((plain.logps * p["g"].float()).sum(), grad_inputs(p))
    both = _call(p, opts, "torch", chunk, log_sum_sq_probs=True, **stats)
    both_grads = torch.autograd.grad((both.logps * p["g"].float()).sum(), grad_inputs(p))
    assert plain.log_sum_sq_probs is None
    for a, b in [*zip(plain[:4], both[:4]), *zip(plain_grads, both_grads)]:
        assert torch.equal(a, b)
    _, _, z = run_oracle(p, opts)
    assert rel_err(both.log_sum_sq_probs, _want(z.detach(), p["labels"], opts["temperature"])) <= 2e-6


def test_a_flat_distribution_gives_minus_log_v_and_a_one_hot_zero():
    v = 64
    hidden = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    weight = torch.zeros(v, 1, dtype=torch.float64)
    weight[5, 0] = 1e4  # row 1: all mass on token 5
    out = head_logprobs(hidden, weight, torch.tensor([3, 5]), log_sum_sq_probs=True, backend="torch")
    torch.testing.assert_close(out.log_sum_sq_probs, torch.tensor([-torch.log(torch.tensor(64.0)).item(), 0.0],
                                                                  dtype=torch.float64))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_unfused_path_computes_it_from_the_logits_as_the_definition(temperature):
    """`head.logprobs_from_logits` (the unfused path every fused result is checked against)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 23, dtype=torch.float64) * 3
    labels = torch.randint(0, 23, (2, 5))
    labels[0, :2] = -100
    out = logprobs_from_logits(logits, labels, temperature=temperature, log_sum_sq_probs=True)
    want = _want(logits.reshape(-1, 23), labels.reshape(-1), temperature).view(2, 5)
    torch.testing.assert_close(out.log_sum_sq_probs, want, rtol=1e-12, atol=1e-12)
    assert logprobs_from_logits(logits, labels, temperature=temperature).log_sum_sq_probs is None


# --------------------------------------------------------------------------- dispatch


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The registered Triton backend (its own `statistics`), made runnable on the CPU with a stub `run`."""
    real = registry._lookup("triton")
    ran = []

    def stub(hidden, weight, labels, bias, low_rank, opts):
        ran.append(opts)
        zero = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
        return HeadOutput(zero, None, None, None, backend="triton")

    fake = dataclasses.replace(real, run=stub, unavailable_reason=lambda device: None, blocks=None)
    monkeypatch.setitem(registry._BACKENDS, "triton", fake)
    monkeypatch.setitem(registry._LAZY_DEVICE_TYPES, "triton", ("cpu",))
    return ran


def test_auto_runs_the_chunked_torch_backend_when_the_statistic_is_asked_for(triton_on_cpu):
    p = make_problem(9, 17, 4, dtype=torch.float32, ignore_frac=0.3)
    assert "log_sum_sq_probs" not in registry._lookup("triton").statistics  # its kernels lack it
    assert head_logprobs(p["hidden"], p["weight"], p["labels"], entropy=True).backend == "triton"
    assert len(triton_on_cpu) == 1
    out = head_logprobs(p["hidden"], p["weight"], p["labels"], entropy=True, log_sum_sq_probs=True)
    assert out.backend == "torch-chunked" and len(triton_on_cpu) == 1
    assert out.log_sum_sq_probs is not None and out.log_sum_sq_probs.abs().sum() > 0
    with pytest.raises(BackendUnavailableError, match="backend 'triton' cannot run on cpu: it does not compute "
                                                      "log_sum_sq_probs"):
        head_logprobs(p["hidden"], p["weight"], p["labels"], log_sum_sq_probs=True, backend="triton")


def test_the_loss_aware_mode_refuses_the_statistic():
    p = make_problem(6, 11, 3, dtype=torch.float32)
    loss = SequenceLoss(torch.zeros(6, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.ones_like)
    with pytest.raises(ValueError, match="sequence_loss and log_sum_sq_probs=True cannot be combined"):
        head_logprobs(p["hidden"], p["weight"], p["labels"], log_sum_sq_probs=True, sequence_loss=loss)
