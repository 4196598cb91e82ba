"""GRPO losses against hand transcriptions of TRL 1.16's formulas (written here, in loops).

The reference below follows `GRPOTrainer._compute_loss` and `_generate_and_score_completions`
of TRL 1.16 token by token in plain Python over scalar tensors, so that values AND gradients
can be compared with the vectorised implementation.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fusedalign.losses import (
    GRPO_LOSS_TYPES,
    GRPOOptions,
    count_items,
    entropy_threshold,
    entropy_weight,
    group_advantages,
    grpo_loss,
    high_entropy_mask,
)
from fusedalign.losses.grpo import quantile
from fusedalign.losses.grpo_metrics import RewardMetrics
from fusedalign.metrics import logged_values

NAN = float("nan")
L_MAX = 7


# ------------------------------------------------------------------ the reference (TRL 1.16, by hand)


def _sigmoid(x):
    return 1 / (1 + torch.exp(-x))


def trl_per_token_loss(lp, old, ref, adv, mask, o: dict, ent_mask=None):
    """Rows of per-token losses (lists of scalar tensors), TRL's order of operations."""
    B, T = lp.shape
    eps_lo = o["epsilon"]
    eps_hi = o["epsilon"] if o["epsilon_high"] is None else o["epsilon_high"]
    rows = []
    for i in range(B):
        n = sum(float(mask[i, t]) for t in range(T))
        seq_lw = sum((lp[i, t] - old[i, t]) * mask[i, t] for t in range(T)) / max(1.0, n)
        phi = None
        if o["loss_type"] == "vespo":
            s = sum(torch.clamp(lp[i, t] - old[i, t], -20, 20) * mask[i, t] for t in range(T)).detach()
            log_w = min(max(float(s), math.log(1e-8)), 20.0)
            k, lam = (2.0, 3.0) if float(adv[i]) >= 0 else (3.0, 2.0)
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        row = []
        for t in range(T):
            lw = seq_lw if o["importance_sampling_level"] == "sequence" else lp[i, t] - old[i, t]
            r = torch.exp(lw)
            a = float(adv[i])
            if o["loss_type"] == "cispo":
                L = -torch.clamp(r, max=eps_hi).detach() * a * lp[i, t]
            elif o["loss_type"] == "sapo":
                tau = 1.0 if a > 0 else 1.05
                L = -_sigmoid(tau * (r - 1)) * 4 / tau * a
            elif o["loss_type"] == "vespo":
                L = -phi * a * lp[i, t]
            else:
                r2 = torch.clamp(r, 1 - eps_lo, 1 + eps_hi)
                r1 = r if o["delta"] is None else torch.clamp(r, max=o["delta"])
                L = -torch.minimum(r1 * a, r2 * a)
            if ent_mask is not None:
                L = L * float(ent_mask[i, t])
            if o["beta"] != 0:
                d = ref[i, t] - lp[i, t]
                kl = torch.exp(d) - d - 1
                if o["use_bias_correction_kl"]:
                    kl = kl * r
                L = L + o["beta"] * kl
            row.append(L)
        rows.append(row)
    return rows


def trl_loss(lp, old, ref, adv, mask, o: dict, ent_mask=None):
    """TRL's micro-batch loss with one process, no accumulation, generation batch = this micro-batch."""
    rows = trl_per_token_loss(lp, old, ref, adv, mask, o, ent_mask)
    B, T = mask.shape
    m = [[float(mask[i, t]) for t in range(T)] for i in range(B)]
    sums = [sum(rows[i][t] * m[i][t] for t in range(T)) for i in range(B)]
    n_rows = [sum(m[i]) for i in range(B)]
    total = sum(sums)
    lt = o["loss_type"]
    if lt in ("grpo", "sapo"):
        return sum(s / max(1.0, n) for s, n in zip(sums, n_rows)) / B
    if lt == "bnpo":
        return total / max(1.0, sum(n_rows))
    if lt == "dr_grpo":
        return total / (B * L_MAX)
    if lt in ("dapo", "cispo", "vespo"):
        return total / max(1.0, sum(n_rows))
    if lt == "luspo":
        return total / B
    raise AssertionError(lt)


def trl_clip_ratios(lp, old, adv, mask, o: dict):
    """clip_ratio/* as TRL logs them for one micro-batch on one process."""
    B, T = mask.shape
    eps_lo = o["epsilon"]
    eps_hi = o["epsilon"] if o["epsilon_high"] is None else o["epsilon_high"]
    seq = o["importance_sampling_level"] == "sequence"
    low, high, per_row_low, per_row_high = [], [], [], []
    for i in range(B):
        n = sum(float(mask[i, t]) for t in range(T))
        lw_seq = sum(float(lp[i, t] - old[i, t]) * float(mask[i, t]) for t in range(T)) / max(1.0, n)
        flags = []
        for t in range(1 if seq else T):
            r = math.exp(lw_seq if seq else float(lp[i, t] - old[i, t]))
            if o["delta"] is not None:
                r = min(r, o["delta"])
            a = float(adv[i])
            flags.append((float(r < 1 - eps_lo and a < 0), float(r > 1 + eps_hi and a > 0), 1.0 if seq else float(mask[i, t])))
        lo = [f[0] for f in flags if f[2]]
        hi = [f[1] for f in flags if f[2]]
        low += lo
        high += hi
        if lo:
            per_row_low.append(sum(lo) / len(lo))
            per_row_high.append(sum(hi) / len(hi))
    region = [max(a, b) for a, b in zip(low, high)]
    mean = lambda v: sum(v) / max(1, len(v))  # noqa: E731
    return {
        "clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high), "clip_ratio/region_mean": mean(region),
        "clip_ratio/low_min": min(per_row_low), "clip_ratio/high_max": max(per_row_high),
    }


# ------------------------------------------------------------------ data


def batch(seed=0, B=5, T=6, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    lp = (old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 2 * spread).clamp(max=-1e-3)
    ref = old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = [T, 3, 0, 5, 1][:B]  # uneven, and one fully masked row
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    # The op gives 0 off the completion (ignored labels): keep the reference honest about it.
    return lp * mask, old * mask, ref * mask, adv, mask


def options(loss_type, level, eps_high, delta, beta, bias):
    return dict(loss_type=loss_type, importance_sampling_level=level, epsilon=0.2, epsilon_high=eps_high, delta=delta,
                beta=beta, use_bias_correction_kl=bias)


def ours(o: dict) -> GRPOOptions:
    return GRPOOptions(**o, max_completion_length=L_MAX)


LOSS_CASES = [
    (lt, level, eh, d, beta, bias)
    for lt in GRPO_LOSS_TYPES
    for level in ("token", "sequence")
    for eh in (None, 5.0 if lt == "cispo" else 0.28)
    for d in (None, 1.3)
    for beta, bias in ((0.0, True), (0.04, True), (0.04, False))
]


@pytest.mark.parametrize("lt,level,eh,delta,beta,bias", LOSS_CASES)
def test_loss_value_and_gradient_equal_trl(lt, level, eh, delta, beta, bias):
    o = options(lt, level, eh, delta, beta, bias)
    lp, old, ref, adv, mask = batch(seed=hash((lt, level)) % 1000)
    x = lp.clone().requires_grad_()
    want = trl_loss(x, old, ref, adv, mask, o)
    (want_grad,) = torch.autograd.grad(want, x)

    y = lp.clone().requires_grad_()
    out = grpo_loss(y, mask, adv, ours(o), old_logps=old, ref_logps=ref if beta else None)
    got = out.loss_sum / out.items  # one process, one micro-batch: the base divides by the step's items
    (got_grad,) = torch.autograd.grad(got, y)
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
    assert out.items == count_items(mask, lt)


@pytest.mark.parametrize("lt,level,eh,delta", [c[:4] for c in LOSS_CASES if c[0] in ("grpo", "dapo", "luspo") and c[4] == 0])
def test_clip_ratios_equal_trl(lt, level, eh, delta):
    o = options(lt, level, eh, delta, 0.0, True)
    lp, old, ref, adv, mask = batch(seed=3, spread=1.0)
    out = grpo_loss(lp, mask, adv, ours(o), old_logps=old)
    logged = logged_values(out.metrics)
    want = trl_clip_ratios(lp, old, adv, mask, o)
    assert want["clip_ratio/region_mean"] > 0  # the batch does clip
    for key, value in want.items():
        assert logged[key] == pytest.approx(value, abs=1e-12), key


def test_kl_entropy_and_cispo_vespo_metrics():
    lp, old, ref, adv, mask = batch(seed=4, spread=1.0)
    ent = torch.rand_like(lp) * mask
    o = options("cispo", "token", 1.1, None, 0.04, True)
    logged = logged_values(grpo_loss(lp, mask, adv, ours(o), old_logps=old, ref_logps=ref, entropy=ent).metrics)
    r = torch.exp(lp - old)
    kl = (torch.exp(ref - lp) - (ref - lp) - 1) * r
    assert logged["kl"] == pytest.approx(float((kl * mask).sum() / mask.sum()), rel=1e-12)
    assert logged["entropy"] == pytest.approx(float((ent * mask).sum() / mask.sum()), rel=1e-12)
    clipped = ((r > 1.1) & (adv[:, None] > 0)).double()
    assert logged["cispo_clip_ratio"] == pytest.approx(float((clipped * mask).sum() / mask.sum()), rel=1e-12)
    assert "clip_ratio/low_mean" not in logged
    o = options("vespo", "token", None, None, 0.0, True)
    logged = logged_values(grpo_loss(lp, mask, adv, ours(o), old_logps=old).metrics)
    phis = []
    for i in range(lp.shape[0]):
        log_w = min(max(float(((lp - old)[i] * mask[i]).sum()), math.log(1e-8)), 20.0)
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        phis.append(math.exp(lam + k * log_w - lam * math.exp(log_w)))
    assert logged["vespo/phi_seq_mean"] == pytest.approx(sum(phis) / len(phis), rel=1e-12)


def test_on_policy_ratio_is_one_and_loss_is_minus_advantage_weighted_logp():
    # old_logps=None: r == 1 exactly, no clipping, and the gradient of -A * logp (token mean for dapo).
    lp, _, _, adv, mask = batch(seed=5)
    x = lp.clone().requires_grad_()
    out = grpo_loss(x, mask, adv, GRPOOptions(loss_type="dapo"))
    logged = logged_values(out.metrics)
    assert logged["clip_ratio/region_mean"] == 0.0 and logged["clip_ratio/high_max"] == 0.0
    assert float(out.loss_sum.detach()) == pytest.approx(-float((adv[:, None] * mask).sum()), rel=1e-12)
    (g,) = torch.autograd.grad(out.loss_sum, x)
    torch.testing.assert_close(g, -(adv[:, None] * mask))


def test_entropy_mask_and_quantile():
    lp, old, ref, adv, mask = batch(seed=6, spread=1.0)
    ent = torch.rand_like(lp) * mask
    valid = ent[mask.bool()]
    for q in (0.0, 0.2, 0.5, 1.0):
        assert quantile(valid, q) == pytest.approx(float(torch.quantile(valid, q)), rel=1e-12)
    thr = entropy_threshold(valid, 0.2)  # keep the top 20 %
    keep = high_entropy_mask(ent, mask, thr)
    assert torch.equal(keep, (ent >= torch.quantile(valid, 0.8)) & mask.bool())
    assert 0 < keep.sum() < mask.sum()
    assert not (keep & ~mask.bool()).any()
    assert entropy_threshold(valid[:0], 0.2) is None
    assert not high_entropy_mask(ent, mask, None).any()
    # The loss keeps only masked-in tokens' policy term; the KL stays on every token (TRL's order).
    for lt in ("dapo", "grpo"):
        o = options(lt, "token", None, None, 0.04, True)
        x, y = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        want = trl_loss(x, old, ref, adv, mask, o, ent_mask=keep)
        out = grpo_loss(y, mask, adv, ours(o), old_logps=old, ref_logps=ref, entropy_mask=keep)
        got = out.loss_sum / out.items
        torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(torch.autograd.grad(got, y)[0], torch.autograd.grad(want, x)[0], rtol=1e-10, atol=1e-12)


def test_entropy_bonus_is_a_token_mean_over_the_step():
    lp, old, _, adv, mask = batch(seed=7)
    ent = (torch.rand_like(lp) * mask).requires_grad_()
    o = GRPOOptions(loss_type="grpo")
    plain = grpo_loss(lp, mask, adv, o, old_logps=old)
    w = entropy_weight(0.01, plain.items, mask.sum())
    bonus = grpo_loss(lp, mask, adv, o, old_logps=old, entropy=ent, entropy_weight=w)
    want = plain.loss_sum / plain.items - 0.01 * (ent * mask).sum() / mask.sum()
    torch.testing.assert_close(bonus.loss_sum / bonus.items, want)
    (g,) = torch.autograd.grad(bonus.loss_sum / bonus.items, ent)
    torch.testing.assert_close(g, -0.01 * mask / mask.sum())


@pytest.mark.parametrize("lt", GRPO_LOSS_TYPES)
def test_all_masked_micro_batch_gives_a_connected_zero(lt):
    lp, old, ref, adv, mask = batch(seed=8)
    mask = torch.zeros_like(mask)
    x = (lp * 0).requires_grad_()
    out = grpo_loss(x, mask, adv, GRPOOptions(loss_type=lt, beta=0.04, max_completion_length=L_MAX),
                    old_logps=old * 0, ref_logps=ref * 0, entropy=torch.zeros_like(x))
    assert torch.isfinite(out.loss_sum) and float(out.loss_sum) == 0.0
    assert out.loss_sum.requires_grad
    (g,) = torch.autograd.grad(out.loss_sum, x)
    assert torch.equal(g, torch.zeros_like(g))
    logged = logged_values(out.metrics)
    assert all(math.isfinite(v) for v in logged.values()), logged


def _step_gradient(lt, splits, ranks=1):
    """Gradient of one optimizer step on 8 sequences of uneven lengths, split over ranks x micro-batches.

    Each micro-batch is padded only to its own longest completion. The base's loss is
    loss_sum * ranks / (items of the whole step); backends average gradients over ranks.
    """
    g = torch.Generator().manual_seed(11)
    B, T = 8, 9
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.1
    lp = old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    ref = old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = [9, 2, 5, 0, 7, 1, 3, 8]
    x = lp.clone().requires_grad_()
    o = GRPOOptions(loss_type=lt, beta=0.04, epsilon_high=0.28, max_completion_length=L_MAX)
    rows = torch.arange(B).chunk(ranks * splits)
    masks = []
    for r in rows:
        n = max(1, max(lengths[i] for i in r.tolist()))
        m = torch.zeros(len(r), n, dtype=torch.float64)
        for j, i in enumerate(r.tolist()):
            m[j, : lengths[i]] = 1
        masks.append(m)
    total = sum(count_items(m, lt) for m in masks)
    loss = 0
    for r, m in zip(rows, masks):
        n = m.shape[1]
        out = grpo_loss(x[r, :n] * m, m, adv[r], o, old_logps=old[r, :n] * m, ref_logps=ref[r, :n] * m)
        loss = loss + out.loss_sum * ranks / total / ranks  # / ranks: the backend's average over ranks
    (grad,) = torch.autograd.grad(loss, x)
    return grad


@pytest.mark.parametrize("lt", [t for t in GRPO_LOSS_TYPES if t != "bnpo"])
def test_one_step_gradient_does_not_depend_on_the_split(lt):
    whole = _step_gradient(lt, splits=1)  # 1 process x 1 micro-batch of 8
    assert whole.abs().sum() > 0
    torch.testing.assert_close(_step_gradient(lt, splits=4), whole, rtol=1e-12, atol=1e-14)  # 1 x 4 x 2
    torch.testing.assert_close(_step_gradient(lt, splits=2, ranks=2), whole, rtol=1e-12, atol=1e-14)  # 2 x 2 x 2


def test_bnpo_depends_on_the_split_by_definition():
    # bnpo is a mean of per-micro-batch token means: with uneven lengths, splits differ (as in TRL).
    assert not torch.allclose(_step_gradient("bnpo", splits=4), _step_gradient("bnpo", splits=1))


# ------------------------------------------------------------------ advantages


def _nanstd(v):
    v = [x for x in v if not math.isnan(x)]
    if len(v) < 2:
        return NAN
    mu = sum(v) / len(v)
    return math.sqrt(sum((x - mu) ** 2 for x in v) / (len(v) - 1))


def _nanmean(v):
    v = [x for x in v if not math.isnan(x)]
    return sum(v) / len(v) if v else NAN


def trl_advantages(rewards, weights, G, scale, aggregation):
    """TRL 1.16's advantages, in plain Python."""
    N, K = len(rewards), len(weights)
    unscorable = [all(math.isnan(x) for x in row) for row in rewards]
    if aggregation == "sum_then_normalize":
        r = [NAN if u else sum(w * x for w, x in zip(weights, row) if not math.isnan(x)) for row, u in zip(rewards, unscorable)]
        groups = [r[i - i % G: i - i % G + G] for i in range(N)]
        std = [_nanstd(r)] * N if scale == "batch" else [_nanstd(gr) for gr in groups]
        adv = [x - _nanmean(gr) for x, gr in zip(r, groups)]
        if scale != "none":
            adv = [a / (s + 1e-4) for a, s in zip(adv, std)]
    else:
        z = [[0.0] * K for _ in range(N)]
        for k in range(K):
            col = [row[k] for row in rewards]
            for i in range(N):
                gr = col[i - i % G: i - i % G + G]
                z[i][k] = (col[i] - _nanmean(gr)) / (_nanstd(gr) + 1e-4)
        s = [NAN if u else sum(w * x for w, x in zip(weights, row) if not math.isnan(x)) for row, u in zip(z, unscorable)]
        std = [_nanstd(s)] * N
        adv = [(x - _nanmean(s)) / (std[0] + 1e-4) for x in s]
    adv = [0.0 if math.isnan(a) else a for a in adv]
    zero = [(not math.isnan(x)) and abs(x) <= 1e-8 for x in std]
    return adv, zero


REWARDS = [  # 3 groups of 4, two functions; None (NaN) here and there, one row unscored, one constant group
    [1.0, 0.5], [0.0, NAN], [2.0, 1.0], [NAN, NAN],
    [0.3, 0.3], [0.3, 0.3], [0.3, 0.3], [0.3, 0.3],
    [NAN, 2.0], [1.5, NAN], [0.2, 0.1], [4.0, 0.0],
]


@pytest.mark.parametrize("scale,aggregation", list(itertools.product(
    ("group", "batch", "none"), ("sum_then_normalize", "normalize_then_sum"))))
def test_advantages_equal_trl(scale, aggregation):
    weights = [1.0, 0.5]
    out = group_advantages(torch.tensor(REWARDS), torch.tensor(weights), 4, scale, aggregation)
    want, zero = trl_advantages(REWARDS, weights, 4, scale, aggregation)
    torch.testing.assert_close(out.advantages, torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert out.advantages[3] == 0.0  # unscored: no signal
    assert out.std_is_zero.tolist() == zero
    if aggregation == "sum_then_normalize" and scale != "batch":
        assert out.std_is_zero[4:8].all()  # the constant group


def test_reward_metrics_of_each_rank_add_up_to_the_batch():
    weights = torch.tensor([1.0, 0.5])
    rewards = torch.tensor(REWARDS)
    adv = group_advantages(rewards, weights, 4)
    names = ["a", "b"]
    whole = logged_values(RewardMetrics.of(rewards, adv.rewards, adv.std_is_zero, names))
    parts = logged_values(*[RewardMetrics.of(rewards[s], adv.rewards[s], adv.std_is_zero[s], names)
                            for s in (slice(0, 6), slice(6, 12))])
    assert whole == pytest.approx(parts)
    r = [x for x in adv.rewards.tolist() if not math.isnan(x)]
    assert whole["reward"] == pytest.approx(sum(r) / len(r))
    assert whole["reward_std"] == pytest.approx(_nanstd(r))
    assert whole["rewards/b/mean"] == pytest.approx(_nanmean([row[1] for row in REWARDS]))
    assert whole["rewards/a/std"] == pytest.approx(_nanstd([row[0] for row in REWARDS]))
    assert whole["frac_reward_zero_std"] == pytest.approx(float(adv.std_is_zero.float().mean()))


def test_a_reward_function_that_scored_nothing_in_the_window_is_logged_as_none():
    """TRL 1.16 logs the key with None when a function scored no completion of the window (its
    NaN per generation batch filtered out at logging); a batch that did score gives the window
    its mean over the scored completions alone."""
    names = ["a", "b"]
    unscored_b = torch.tensor([[1.0, NAN], [3.0, NAN], [0.0, NAN], [2.0, NAN]])
    adv = group_advantages(unscored_b, torch.tensor([1.0, 1.0]), 2)
    window = logged_values(RewardMetrics.of(unscored_b, adv.rewards, adv.std_is_zero, names))
    assert window["rewards/b/mean"] is None and window["rewards/b/std"] is None
    assert window["rewards/a/mean"] == pytest.approx(1.5) and window["reward"] == pytest.approx(1.5)
    nothing = torch.full((4, 2), NAN)
    none_adv = group_advantages(nothing, torch.tensor([1.0, 1.0]), 2)
    empty = logged_values(RewardMetrics.of(nothing, none_adv.rewards, none_adv.std_is_zero, names))
    assert {k: empty[k] for k in ("reward", "reward_std", "rewards/a/mean", "rewards/b/std")} == dict.fromkeys(
        ("reward", "reward_std", "rewards/a/mean", "rewards/b/std"))
    assert empty["frac_reward_zero_std"] == 0.0  # as TRL's: a NaN group's std is not close to 0
    scored_later = torch.tensor([[1.0, 4.0], [3.0, NAN], [0.0, 2.0], [2.0, NAN]])
    later = group_advantages(scored_later, torch.tensor([1.0, 1.0]), 2)
    both = logged_values(RewardMetrics.of(unscored_b, adv.rewards, adv.std_is_zero, names),
                         RewardMetrics.of(scored_later, later.rewards, later.std_is_zero, names))
    assert both["rewards/b/mean"] == pytest.approx(3.0)


def test_advantage_checks():
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(torch.zeros(6, 1), torch.ones(1), 4)
    with pytest.raises(ValueError, match="one value per reward function"):
        group_advantages(torch.zeros(8, 2), torch.ones(1), 4)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(8, 1), torch.ones(1), 4, scale_rewards="std")
    with pytest.raises(ValueError, match="dr_grpo"):
        GRPOOptions(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="loss_type"):
        GRPOOptions(loss_type="ppo")


def test_generator_importance_weight_multiplies_the_policy_term_not_the_kl():
    lp, old, ref, adv, mask = batch(seed=9, spread=1.0)
    w = torch.rand_like(lp) + 0.5
    o = options("dapo", "token", 0.28, None, 0.0, True)
    x = lp.clone().requires_grad_()
    rows = trl_per_token_loss(x, old, ref, adv, mask, o)
    d = ref - x
    kl = (torch.exp(d) - d - 1) * torch.exp(x - old)
    want = sum(rows[i][t] * w[i, t] * mask[i, t] + 0.04 * kl[i, t] * mask[i, t]
               for i in range(lp.shape[0]) for t in range(lp.shape[1])) / mask.sum()
    y = lp.clone().requires_grad_()
    out = grpo_loss(y, mask, adv, ours({**o, "beta": 0.04}), old_logps=old, ref_logps=ref, is_ratio=w)
    got = out.loss_sum / out.items
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(got, y)[0], torch.autograd.grad(want, x)[0], rtol=1e-10, atol=1e-12)
    # vespo folds the generator's weight into the sequence ratio of its gamma weight instead.
    o = options("vespo", "token", None, None, 0.0, True)
    ws = torch.full((lp.shape[0], 1), 1.3, dtype=torch.float64)
    out = grpo_loss(lp, mask, adv, ours(o), old_logps=old, is_ratio=ws)
    phis = []
    for i in range(lp.shape[0]):
        log_w = min(max(float(((lp - old)[i] * mask[i]).sum()) + math.log(1.3), math.log(1e-8)), 20.0)
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        phis.append(math.exp(lam + k * log_w - lam * math.exp(log_w)))
    want = sum(-phis[i] * float(adv[i]) * float((lp[i] * mask[i]).sum()) for i in range(lp.shape[0])) / float(mask.sum())
    assert float(out.loss_sum / out.items) == pytest.approx(want, rel=1e-10)


def _pooled(metric_sets) -> dict[str, float]:
    """The logged value of each statistic over several micro-batches' metrics (as the recorder pools them)."""
    pooled: dict[str, list] = {}
    for metrics in metric_sets:
        for name, stat in metrics.stats():
            kind = type(stat).__name__
            if kind == "Mean":
                s, c = pooled.setdefault(name, [0.0, 0.0])
                pooled[name] = [s + float(stat.sum.sum()), c + float(stat.count.sum())]
            else:
                pick = min if kind == "Min" else max
                value = pick(stat.value.tolist())
                pooled[name] = [value if name not in pooled else pick(pooled[name][0], value)]
    return {k: v[0] / v[1] if len(v) == 2 else v[0] for k, v in pooled.items()}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("lt", GRPO_LOSS_TYPES)
def test_metrics_do_not_depend_on_the_split(lt, level):
    """Every row its own micro-batch, as wide as its completion: a one-token completion and an empty
    one give micro-batches of width 1, whose per-token values are [B, 1] like a per-sequence value."""
    g = torch.Generator().manual_seed(5)
    lengths = [9, 2, 5, 0, 7, 1, 3, 1]
    B, T = len(lengths), max(lengths)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * mask
    old = (lp + 0.3 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)) * mask
    ref = (old + 0.2 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)) * mask
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * mask
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    o = GRPOOptions(loss_type=lt, beta=0.04, epsilon_high=0.28, importance_sampling_level=level,
                    max_completion_length=L_MAX)

    def metrics(rows, width):
        return grpo_loss(lp[rows, :width], mask[rows, :width], adv[rows], o, old_logps=old[rows, :width],
                         ref_logps=ref[rows, :width], entropy=ent[rows, :width]).metrics

    whole = _pooled([metrics(list(range(B)), T)])
    split = _pooled([metrics([i], max(n, 1)) for i, n in enumerate(lengths)])
    assert set(split) == set(whole) and "entropy" in whole
    for name, value in whole.items():
        assert split[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name


def test_bnpo_in_parts_divides_by_the_whole_micro_batchs_tokens():
    """A micro-batch trained in parts (a token budget): each part's bnpo sum over the micro-batch's loss
    tokens, so the parts' sums add up to the whole micro-batch's, values and gradients."""
    g = torch.Generator().manual_seed(3)
    lengths = [4, 1, 0, 3, 2]
    B, T = len(lengths), max(lengths)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * mask).requires_grad_()
    old = (lp.detach() + 0.2 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)) * mask
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    o = GRPOOptions(loss_type="bnpo", max_completion_length=L_MAX)
    whole = grpo_loss(lp * mask, mask, adv, o, old_logps=old).loss_sum
    tokens = mask.sum()
    parts = [[0, 1], [2, 3, 4]]
    split = sum(grpo_loss(lp[p] * mask[p], mask[p], adv[p], o, old_logps=old[p], micro_batch_tokens=tokens).loss_sum
                for p in parts)
    assert split.item() == pytest.approx(whole.item(), rel=1e-12)
    (g_whole,) = torch.autograd.grad(whole, lp)
    (g_split,) = torch.autograd.grad(split, lp)
    torch.testing.assert_close(g_split, g_whole, rtol=1e-12, atol=1e-15)
    alone = sum(grpo_loss(lp[p] * mask[p], mask[p], adv[p], o, old_logps=old[p]).loss_sum for p in parts)
    assert alone.item() != pytest.approx(whole.item(), rel=1e-6)  # each part's own mean is another loss
