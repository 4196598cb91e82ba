"""RLOO's advantages and loss against TRL 1.16's formulas computed by hand (plain Python loops)."""

from __future__ import annotations

import math

import pytest
import torch

from fusedalign.losses import rloo_advantages, rloo_loss

NAN = float("nan")


def _by_hand_advantages(rewards, weights, G, kl, beta, clip, normalize):
    """TRL 1.16 `RLOOTrainer._generate_and_score_completions`, one completion at a time."""
    total = []
    for row, k in zip(rewards, kl):
        if all(math.isnan(v) for v in row):
            total.append(NAN)
            continue
        r = sum(w * v for w, v in zip(weights, row) if not math.isnan(v))
        if clip is not None:
            r = min(max(r, clip[0]), clip[1])
        total.append(r - beta * k)
    adv = []
    for i, r in enumerate(total):
        group = total[i // G * G:i // G * G + G]
        others = [v for j, v in enumerate(group) if j != i % G and not math.isnan(v)]
        adv.append(NAN if math.isnan(r) or not others else r - sum(others) / len(others))
    if normalize:
        ok = [a for a in adv if not math.isnan(a)]
        mean = sum(ok) / len(ok)
        std = math.sqrt(sum((a - mean) ** 2 for a in ok) / (len(ok) - 1))
        adv = [(a - mean) / (std + 1e-4) for a in adv]
    return [0.0 if math.isnan(a) else a for a in adv]


REWARDS = [[1.0, 0.5], [0.0, NAN], [2.0, 1.0], [NAN, NAN],  # group 0: one unscored completion
           [0.3, 0.1], [0.3, 0.1], [NAN, 0.7], [1.5, -2.0],  # group 1: NaN in one function only
           [0.2, 0.0], [NAN, NAN], [NAN, NAN], [NAN, NAN]]  # group 2: one scored: no baseline
KL = [0.5, -0.2, 1.0, 0.0, 0.1, 0.3, -0.4, 2.0, 0.7, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("beta,clip,normalize", [(0.0, None, False), (0.05, None, False), (0.3, (0.0, 1.2), False),
                                                  (0.1, (-0.5, 2.0), True)])
def test_advantages_are_trls_leave_one_out_by_hand(beta, clip, normalize):
    weights = [1.0, 0.5]
    got = rloo_advantages(torch.tensor(REWARDS), torch.tensor(weights), 4, torch.tensor(KL), beta=beta,
                          reward_clip_range=clip, normalize_advantages=normalize)
    want = _by_hand_advantages(REWARDS, weights, 4, KL, beta, clip, normalize)
    torch.testing.assert_close(got.advantages, torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert got.advantages[3] == 0.0 and got.advantages[8] == 0.0  # unscored; scored alone in its group
    # The logged reward is the weighted sum, before clipping and KL.
    assert got.rewards[0].item() == pytest.approx(1.25) and math.isnan(got.rewards[3].item())


def test_beta_without_kl_is_refused_and_lone_generations_get_zero():
    with pytest.raises(ValueError, match="sequence_kl"):
        rloo_advantages(torch.ones(4, 1), torch.ones(1), 2, None, beta=0.1)
    assert torch.equal(rloo_advantages(torch.rand(3, 1), torch.ones(1), 1).advantages, torch.zeros(3))


def test_loss_is_trls_clipped_sequence_ratio_by_hand():
    torch.manual_seed(0)
    B, T = 5, 6
    logps = (-torch.rand(B, T, dtype=torch.float64) * 2).requires_grad_()
    old = logps.detach() + torch.randn(B, T, dtype=torch.float64) * 0.05
    old[:, 0] -= torch.tensor([0.5, -0.5, 0.1, 0.0, 0.3], dtype=torch.float64)  # row ratios ~1.6, 0.6, 1.1, 1, 1.3
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] + [0] * 5, [0] * 6, [1] * 5 + [0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 0.8, 2.0, -1.2], dtype=torch.float64)
    eps, eps_high = 0.2, 0.28
    out = rloo_loss(logps, mask, adv, old_logps=old, epsilon=eps, epsilon_high=eps_high)
    want, low, high = 0.0, [], []
    for i in range(B):
        s = sum(float(logps[i, t].detach() - old[i, t]) for t in range(T) if mask[i, t])
        r = math.exp(s)
        a = float(adv[i])
        want += -min(r * a, min(max(r, 1 - eps), 1 + eps_high) * a)
        low.append(float(r < 1 - eps and a < 0))
        high.append(float(r > 1 + eps_high and a > 0))
    assert out.loss_sum.item() == pytest.approx(want, rel=1e-12)
    assert out.items.item() == B  # TRL: the mean over the micro-batch's sequences
    stats = {name: s.sum.sum().item() / s.count.sum().item() for name, s in out.metrics.stats()
             if name.endswith("_mean")}
    assert stats["clip_ratio/low_mean"] == pytest.approx(sum(low) / B)
    assert stats["clip_ratio/high_mean"] == pytest.approx(sum(high) / B)
    assert 0 < sum(low) + sum(high) < B  # the example clips some sequences, not all
    out.loss_sum.backward()
    assert torch.all(logps.grad[~mask] == 0) and logps.grad[mask].abs().sum() > 0


def test_on_policy_loss_is_minus_the_advantages_with_the_reinforce_gradient():
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([0.7, -0.4])
    out = rloo_loss(logps, mask, adv)
    assert out.loss_sum.item() == pytest.approx(-0.3)
    out.loss_sum.backward()  # d/dlogp of -r A at r = 1: -A on each loss token
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.7, -0.7], [0.4, 0.0]]))
