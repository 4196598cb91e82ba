"""f-DPO (`f_divergence_type`): every allowed loss type against TRL 1.16's formula, written here
in float64 with plain `math`, one pair at a time; the refusals for the other loss types."""

import math

import pytest
import torch

from fusedalign.configs import DPOConfig
from fusedalign.losses import F_DIVERGENCE_LOSS_TYPES, check_dpo_args, dpo_losses
# The three pairs of the DPO loss tests: log-ratios of both signs and of a few units, so that
# every score function bends.
from tests.unit.test_losses_dpo import BETA, EPS, LC, LR, RC, RR, TAU, C, R


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x):
    return math.exp(logsig(x))


def trl_score(f_type, u, coef):
    """TRL 1.16's `chosen_scores` / `rejected_scores` of one log-ratio u (dpo_trainer._compute_loss)."""
    if f_type == "reverse_kl":
        return u
    if f_type == "forward_kl":
        return 1 - math.exp(-u)
    if f_type == "js_divergence":
        return math.log(2) + logsig(u)
    if abs(coef - 1.0) < 1e-6:  # alpha_divergence's limit: reverse_kl
        return u
    return (math.exp(min((coef - 1.0) * u, 80.0)) - 1.0) * (1.0 / (coef - 1.0))


def trl_loss(loss_type, f_type, coef, i, b=BETA, eps=EPS, tau=TAU):
    """TRL 1.16's per-sequence loss of pair i (its `sft` is the batch's token mean, see the test)."""
    cs, rs = trl_score(f_type, C[i] - RC[i], coef), trl_score(f_type, R[i] - RR[i], coef)
    d = cs - rs
    if loss_type == "sigmoid":
        return -logsig(b * d)
    if loss_type == "hinge":
        return max(0.0, 1 - b * d)
    if loss_type == "ipo":
        return (cs / LC[i] - rs / LR[i] - 1 / (2 * b)) ** 2
    if loss_type == "exo_pair":
        return sig(b * d) * (logsig(b * d) - math.log1p(-eps)) + sig(-b * d) * (logsig(-b * d) - math.log(eps))
    if loss_type == "robust":
        return (-(1 - eps) * logsig(b * d) + eps * logsig(-b * d)) / (1 - 2 * eps)
    if loss_type == "discopop":
        z = b * d
        gate = sig(z / tau)
        return -logsig(z) * (1 - gate) + math.exp(-z) * gate
    if loss_type == "sigmoid_norm":
        return -logsig(b * (cs / LC[i] - rs / LR[i]))
    assert loss_type == "sft"
    return -sum(C) / sum(LC)  # the token mean over the batch's chosen tokens, expanded to every pair


def ours(loss_type, f_type, coef, b=BETA, eps=EPS, tau=TAU):
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    smoothing = 0.0 if loss_type in ("sigmoid", "sigmoid_norm") else eps  # TRL's sigmoid has no smoothing
    return dpo_losses(t(C), t(R), t(RC), t(RR), loss_type=loss_type, beta=b, label_smoothing=smoothing,
                      discopop_tau=tau, chosen_lengths=t(LC), rejected_lengths=t(LR), f_divergence_type=f_type,
                      f_alpha_divergence_coef=coef)


DIVERGENCES = [("reverse_kl", 0.5), ("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.5),
               ("alpha_divergence", 1.0), ("alpha_divergence", 1.5)]


@pytest.mark.parametrize("f_type,coef", DIVERGENCES, ids=[f"{f}-{c}" for f, c in DIVERGENCES])
@pytest.mark.parametrize("loss_type", sorted(F_DIVERGENCE_LOSS_TYPES))
def test_each_allowed_loss_type_is_trls_formula(loss_type, f_type, coef):
    out = ours(loss_type, f_type, coef)
    want = torch.tensor([trl_loss(loss_type, f_type, coef, i) for i in range(3)], dtype=torch.float64)
    if loss_type == "sft":  # ours spreads the token mean over the pairs: the same mean, TRL's loss
        torch.testing.assert_close(out.losses.mean(), want.mean(), rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(out.losses, want, rtol=1e-12, atol=1e-12)
    # The rewards logged stay beta * log-ratio whatever the divergence, as TRL's.
    want_rewards = [[BETA * (C[i] - RC[i]) for i in range(3)], [BETA * (R[i] - RR[i]) for i in range(3)]]
    torch.testing.assert_close(torch.stack([out.chosen_rewards, out.rejected_rewards]),
                               torch.tensor(want_rewards, dtype=torch.float64))


def test_the_divergences_differ_and_alpha_one_is_reverse_kl_exactly():
    """So that the test above can fail: each divergence gives its own sigmoid loss; alpha = 1 is
    TRL's fallback to the reverse KL, bit for bit."""
    by_type = {f: ours("sigmoid", f, 0.5).losses for f in ("reverse_kl", "forward_kl", "js_divergence",
                                                            "alpha_divergence")}
    values = list(by_type.values())
    assert all((a - b).abs().min() > 1e-3 for i, a in enumerate(values) for b in values[i + 1:])
    assert torch.equal(ours("sigmoid", "alpha_divergence", 1.0).losses, by_type["reverse_kl"])
    assert torch.equal(ours("sigmoid", "alpha_divergence", 1.0 + 1e-7).losses, by_type["reverse_kl"])


def test_alpha_divergence_clamps_its_exponent_and_stays_finite_in_float32():
    """(alpha - 1) * logratio is clamped at 80 as in TRL, so a large log-ratio gives a finite score."""
    t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    out = dpo_losses(t([60.0]), t([-1.0]), t([0.0]), t([0.0]), loss_type="hinge", beta=BETA,
                     f_divergence_type="alpha_divergence", f_alpha_divergence_coef=3.0)
    score = (math.exp(80.0) - 1.0) / 2.0  # exponent 2 * 60 = 120, clamped
    rejected = (math.exp(-2.0) - 1.0) / 2.0
    assert torch.isfinite(out.losses).all()
    assert out.losses.item() == pytest.approx(max(0.0, 1 - BETA * (score - rejected)), rel=1e-6)


@pytest.mark.parametrize("loss_type", ["nca_pair", "bco_pair", "sppo_hard", "aot", "aot_pair", "aot_unpaired",
                                       "apo_zero", "apo_down"])
def test_a_loss_type_without_an_f_divergence_form_is_refused(loss_type, tmp_path):
    message = (f"f_divergence_type='js_divergence' needs loss types built on the chosen-rejected reward difference "
               rf"\(discopop, exo_pair, hinge, ipo, robust, sft, sigmoid, sigmoid_norm\); loss_type \['{loss_type}'\]")
    with pytest.raises(ValueError, match=message):
        DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", loss_type], f_divergence_type="js_divergence")
    with pytest.raises(ValueError, match="f_divergence_type='forward_kl' needs"):
        check_dpo_args(loss_type, beta=0.1, f_divergence_type="forward_kl")
    # The default divergence takes every loss type.
    assert check_dpo_args(loss_type, beta=0.1) == [(loss_type, 1.0)]

