"""KTO losses, KL reference point and metrics against hand-computed values."""

import math

import pytest
import torch

from fusedalign.losses import (
    KTO_LOSSES,
    check_kto_args,
    kl_estimate,
    kl_from_sums,
    kl_sums,
    kto_losses,
    kto_metrics,
)
from fusedalign.metrics import logged_values

POLICY = [-2.0, -3.0, -1.5, -4.0]
REF = [-2.5, -2.8, -1.0, -4.4]
DESIRABLE = [True, False, True, False]
BETA, KL, WD, WU = 0.3, 0.2, 1.5, 0.7


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def expected(loss_type, kl=KL, wd=WD, wu=WU, b=BETA):
    out = []
    for p, r, d in zip(POLICY, REF, DESIRABLE):
        lr = p - r
        if loss_type == "kto":
            v = wd * (1 - sig(b * (lr - kl))) if d else wu * (1 - sig(b * (kl - lr)))
        else:  # apo_zero_unpaired
            v = wd * (1 - sig(b * lr)) if d else wu * sig(b * lr)
        out.append(v)
    return torch.tensor(out, dtype=torch.float64)


def inputs(requires_grad=False):
    policy = torch.tensor(POLICY, dtype=torch.float64, requires_grad=requires_grad)
    return policy, torch.tensor(REF, dtype=torch.float64), torch.tensor(DESIRABLE)


KW = dict(beta=BETA, desirable_weight=WD, undesirable_weight=WU)


@pytest.mark.parametrize("loss_type", sorted(KTO_LOSSES))
def test_each_type_matches_its_formula(loss_type):
    policy, ref, desirable = inputs()
    out = kto_losses(policy, ref, torch.tensor(KL, dtype=torch.float64), desirable,
                     loss_type=loss_type, **KW)
    torch.testing.assert_close(out.losses, expected(loss_type), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.rewards, BETA * (policy - ref))
    assert torch.equal(out.desirable, desirable)


def test_defaults_and_float_kl():
    policy, ref, desirable = inputs()
    out = kto_losses(policy, ref, 0.0, desirable, beta=BETA)
    torch.testing.assert_close(out.losses, expected("kto", kl=0.0, wd=1.0, wu=1.0))


def test_kl_shifts_kto_but_not_apo_zero_unpaired():
    policy, ref, desirable = inputs()
    kto_a = kto_losses(policy, ref, 0.0, desirable, **KW).losses
    kto_b = kto_losses(policy, ref, 1.0, desirable, **KW).losses
    assert not torch.allclose(kto_a, kto_b)
    apo_a = kto_losses(policy, ref, 0.0, desirable, loss_type="apo_zero_unpaired", **KW).losses
    apo_b = kto_losses(policy, ref, 1.0, desirable, loss_type="apo_zero_unpaired", **KW).losses
    torch.testing.assert_close(apo_a, apo_b)


def test_kl_is_detached_and_rewards_too():
    policy, ref, desirable = inputs(requires_grad=True)
    kl = torch.tensor(KL, dtype=torch.float64, requires_grad=True)
    out = kto_losses(policy, ref, kl, desirable, **KW)
    out.losses.sum().backward()
    assert kl.grad is None and not out.rewards.requires_grad
    # d/dp of w * (1 - sigma(+-beta (p - ref - kl))) = -+ w * beta * s (1 - s).
    grads = []
    for p, r, d in zip(POLICY, REF, DESIRABLE):
        s = sig(BETA * ((p - r) - KL)) if d else sig(BETA * (KL - (p - r)))
        grads.append(-WD * BETA * s * (1 - s) if d else WU * BETA * s * (1 - s))
    torch.testing.assert_close(policy.grad, torch.tensor(grads, dtype=torch.float64))


@pytest.mark.parametrize("loss_type", sorted(KTO_LOSSES))
def test_gradcheck(loss_type):
    policy, _, desirable = inputs(requires_grad=True)
    ref = torch.tensor(REF, dtype=torch.float64, requires_grad=True)
    def fn(p, r):
        return kto_losses(p, r, KL, desirable, loss_type=loss_type, **KW).losses

    assert torch.autograd.gradcheck(fn, (policy, ref))


@pytest.mark.parametrize("loss_type", sorted(KTO_LOSSES))
@pytest.mark.parametrize("labels", [[True] * 4, [False] * 4, []])
def test_one_class_or_empty_batch_is_finite_and_connected(loss_type, labels):
    n = len(labels)
    policy = torch.tensor(POLICY[:n], dtype=torch.float64, requires_grad=True)
    out = kto_losses(policy, torch.tensor(REF[:n], dtype=torch.float64), KL,
                     torch.tensor(labels, dtype=torch.bool), loss_type=loss_type, **KW)
    loss = out.losses.sum() / max(n, 1)
    assert torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    assert policy.grad is not None and torch.isfinite(policy.grad).all()
    metrics = kto_metrics(out.rewards, policy, out.desirable).logged()
    assert all(math.isfinite(v) for v in metrics.values())


def test_masked_branch_gets_no_gradient():
    # An undesirable example's gradient must not depend on the desirable weight, and vice versa.
    policy, ref, desirable = inputs(requires_grad=True)
    kto_losses(policy, ref, KL, desirable, beta=BETA, desirable_weight=0.0).losses.sum().backward()
    assert (policy.grad[desirable] == 0).all() and (policy.grad[~desirable] != 0).all()


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="kto_pair"), r"Unknown KTO loss_type.*'apo_zero_unpaired'.*'kto'"),
    (dict(beta=0.0), "beta"),
    (dict(beta=-1.0), "beta"),
    (dict(desirable_weight=-1.0), "desirable_weight"),
    (dict(undesirable_weight=float("nan")), "undesirable_weight"),
])
def test_bad_options_raise(kwargs, match):
    policy, ref, desirable = inputs()
    with pytest.raises(ValueError, match=match):
        kto_losses(policy, ref, KL, desirable, **kwargs)
    with pytest.raises(ValueError, match=match):
        check_kto_args(**{"loss_type": "kto", "beta": 0.1, **kwargs})


def test_labels_must_be_bool():
    policy, ref, _ = inputs()
    with pytest.raises(ValueError, match="bool"):
        kto_losses(policy, ref, KL, torch.tensor([1, 0, 1, 0]))


def test_kl_is_averaged_over_ranks_then_clamped():
    # Rank 0's pairs average +0.5, rank 1's -0.3: the global z0 is max(0, 0.1) = 0.1, whereas
    # clamping before averaging would give 0.25.
    rank0 = kl_sums(torch.tensor([-1.0, -2.0]), torch.tensor([-1.6, -2.4]))
    rank1 = kl_sums(torch.tensor([-3.0, -1.0]), torch.tensor([-2.7, -0.7]))
    est0 = kl_estimate(torch.tensor([-1.0, -2.0]), torch.tensor([-1.6, -2.4]))
    assert est0.item() == pytest.approx(0.5)
    total, count = rank0.sum + rank1.sum, rank0.count + rank1.count
    assert count.item() == 4
    assert kl_from_sums(total, count).item() == pytest.approx(0.1)
    # TRL's way, a mean of per-rank means, goes through the same helper.
    est1 = kl_estimate(torch.tensor([-3.0, -1.0]), torch.tensor([-2.7, -0.7]))
    assert kl_from_sums(est0 + est1, torch.tensor(2.0)).item() == pytest.approx(0.1)
    assert kl_from_sums(torch.tensor(-3.0), torch.tensor(4.0)).item() == 0.0
    assert kl_from_sums(torch.tensor(0.0), torch.tensor(0.0)).item() == 0.0


def test_kl_helpers_are_detached():
    p = torch.tensor([-1.0, -2.0], requires_grad=True)
    assert not kl_sums(p, torch.zeros(2)).sum.requires_grad
    assert not kl_estimate(p, torch.zeros(2)).requires_grad
    assert not kl_from_sums(p.sum(), torch.tensor(2.0)).requires_grad


def test_metrics_sums_reduce_and_skip_a_missing_class():
    rewards = torch.tensor([0.4, -0.2, 0.6, -0.6])
    logps = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    m = kto_metrics(rewards, logps, torch.tensor(DESIRABLE))
    means = m.logged()
    assert means["rewards/chosen"] == pytest.approx(0.5)
    assert means["rewards/rejected"] == pytest.approx(-0.4)
    assert means["rewards/margins"] == pytest.approx(0.9)
    assert means["logps/chosen"] == pytest.approx(-2.0)
    assert means["logps/rejected"] == pytest.approx(-3.0)
    assert means["count/desirable"] == 2 and means["count/undesirable"] == 2
    ranks = [kto_metrics(rewards[i:i + 2], logps[i:i + 2], torch.tensor(DESIRABLE[i:i + 2]))
             for i in (0, 2)]
    assert logged_values(*ranks) == pytest.approx(means)
    only = kto_metrics(rewards[:1], logps[:1], torch.tensor([True])).logged()
    assert "rewards/rejected" not in only and "rewards/margins" not in only
    assert only["rewards/chosen"] == pytest.approx(0.4) and only["count/undesirable"] == 0
