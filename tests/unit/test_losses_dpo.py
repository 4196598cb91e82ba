"""DPO losses against their formulas, recomputed here with plain `math` on 3 pairs."""

import math

import pytest
import torch

from fusedalign.losses import (
    DPO_LOSSES,
    bco_reward_mean,
    check_dpo_args,
    dpo_losses,
    dpo_metrics,
)
from fusedalign.losses.dpo import BATCH_COUPLED_LOSSES
from fusedalign.metrics import logged_values

# Three pairs whose policy and reference orders differ, so the AOT sorts matter, and whose
# margins straddle hinge's kink (beta * h = 0.15, -1.3, 3.7).
C = [-3.0, -5.2, -1.1]  # policy chosen
R = [-4.0, -3.9, -7.5]  # policy rejected
RC = [-3.5, -4.8, -6.0]  # reference chosen
RR = [-4.2, -6.1, -5.0]  # reference rejected
LC = [3, 5, 2]  # chosen completion tokens
LR = [4, 2, 7]  # rejected completion tokens
BETA, EPS, DELTA, TAU = 0.5, 0.1, 0.3, 0.5


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def logsig(x):
    return -math.log1p(math.exp(-x))


def smoothed(z, eps):
    return -(1 - eps) * logsig(z) - eps * logsig(-z)


def expected(loss_type, b=BETA, eps=EPS, delta=DELTA, tau=TAU):
    """Per-pair losses written from the papers' formulas, one pair at a time."""
    out = []
    for i in range(3):
        cw, cl = C[i] - RC[i], R[i] - RR[i]
        h = cw - cl
        if loss_type == "sigmoid":
            v = smoothed(b * h, eps)
        elif loss_type == "robust":
            v = ((1 - eps) * -logsig(b * h) - eps * -logsig(-b * h)) / (1 - 2 * eps)
        elif loss_type == "hinge":
            v = max(0.0, 1 - b * h)
        elif loss_type == "ipo":
            v = (cw / LC[i] - cl / LR[i] - 1 / (2 * b)) ** 2
        elif loss_type == "sigmoid_norm":  # TRL 1.16: no label smoothing
            v = -logsig(b * (cw / LC[i] - cl / LR[i]))
        elif loss_type == "exo_pair":
            q = sig(b * h)
            v = q * (math.log(q) - math.log(1 - eps)) + (1 - q) * (math.log(1 - q) - math.log(eps))
        elif loss_type == "nca_pair":
            v = -logsig(b * cw) - 0.5 * logsig(-b * cw) - 0.5 * logsig(-b * cl)
        elif loss_type == "bco_pair":
            v = -logsig(b * cw - delta) - logsig(-(b * cl - delta))
        elif loss_type == "sppo_hard":
            v = (cw - 1 / (2 * b)) ** 2 + (cl + 1 / (2 * b)) ** 2
        elif loss_type == "apo_zero":
            v = 1 - sig(b * cw) + sig(b * cl)
        elif loss_type == "apo_down":
            v = sig(b * cw) + 1 - sig(b * h)
        elif loss_type == "discopop":
            z = b * h
            g = sig(z / tau)
            v = (1 - g) * -logsig(z) + g * math.exp(-z)
        elif loss_type == "sft":  # TRL: one token mean over all chosen tokens, -sum(C) / sum(LC) over the batch
            v = -C[i] / (sum(LC) / 3)
        elif loss_type == "aot":
            pol = sorted(c - r for c, r in zip(C, R))
            ref = sorted(c - r for c, r in zip(RC, RR))
            v = smoothed(b * (pol[i] - ref[i]), eps)
        elif loss_type in ("aot_pair", "aot_unpaired"):
            chosen = sorted(c - rc for c, rc in zip(C, RC))
            rejected = sorted(r - rr for r, rr in zip(R, RR))
            v = smoothed(b * (chosen[i] - rejected[i]), eps)
        else:
            raise AssertionError(loss_type)
        out.append(v)
    return torch.tensor(out, dtype=torch.float64)


def inputs(dtype=torch.float64, requires_grad=False):
    c, r, rc, rr = (torch.tensor(x, dtype=dtype) for x in (C, R, RC, RR))
    return c.requires_grad_(requires_grad), r.requires_grad_(requires_grad), rc, rr


KW = dict(beta=BETA, label_smoothing=EPS, bco_delta=DELTA, discopop_tau=TAU,
          chosen_lengths=torch.tensor(LC), rejected_lengths=torch.tensor(LR))


def test_table_lists_every_type_of_the_issue():
    wanted = {"sigmoid", "robust", "hinge", "ipo", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
              "aot", "aot_pair", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"}
    assert wanted <= set(DPO_LOSSES)


@pytest.mark.parametrize("loss_type", sorted(DPO_LOSSES))
def test_each_type_matches_its_formula(loss_type):
    out = dpo_losses(*inputs(), loss_type=loss_type, **KW)
    assert out.losses.shape == (3,)
    torch.testing.assert_close(out.losses, expected(loss_type), rtol=1e-12, atol=1e-12)


def test_sigmoid_norm_is_trls_code_on_token_logps():
    """TRL 1.16's sigmoid_norm (dpo_trainer.py), run on per-token log-probs and completion masks of
    different lengths (one completion empty), against ours on their sums and token counts."""
    torch.manual_seed(0)
    mask = torch.zeros(6, 7)  # [2B, T]: chosen rows, then rejected rows, as TRL stacks them
    for row, n in enumerate([3, 7, 1, 5, 2, 0]):
        mask[row, 7 - n:] = 1
    policy, ref = (torch.randn(6, 7, dtype=torch.float64) * mask for _ in range(2))
    # TRL: per-sequence sums, scores = log-ratios (reverse KL), then the sigmoid_norm branch.
    chosen_logps, rejected_logps = policy.sum(1).chunk(2)
    ref_chosen_logps, ref_rejected_logps = ref.sum(1).chunk(2)
    chosen_scores, rejected_scores = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    chosen_mask, rejected_mask = mask.chunk(2, dim=0)
    chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
    rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
    trl = -torch.nn.functional.logsigmoid(BETA * (chosen_avg_score - rejected_avg_score))
    lengths = mask.sum(1)
    ours = dpo_losses(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, loss_type="sigmoid_norm",
                      beta=BETA, label_smoothing=EPS, chosen_lengths=lengths[:3], rejected_lengths=lengths[3:])
    torch.testing.assert_close(ours.losses, trl, rtol=1e-12, atol=1e-12)


def test_sigmoid_without_smoothing_is_plain_dpo_and_default_tau_discopop():
    out = dpo_losses(*inputs(), beta=BETA)
    torch.testing.assert_close(out.losses, expected("sigmoid", eps=0.0))
    out = dpo_losses(*inputs(), loss_type="discopop", beta=BETA)
    torch.testing.assert_close(out.losses, expected("discopop", tau=0.05))


def test_hinge_has_an_inactive_pair_and_bco_default_delta_is_zero():
    hinge = dpo_losses(*inputs(), loss_type="hinge", beta=BETA).losses
    assert hinge[2] == 0 and (hinge[:2] > 0).all()
    bco = dpo_losses(*inputs(), loss_type="bco_pair", beta=BETA).losses
    torch.testing.assert_close(bco, expected("bco_pair", delta=0.0))


def test_rewards_are_beta_logratios_and_detached():
    c, r, rc, rr = inputs(requires_grad=True)
    out = dpo_losses(c, r, rc, rr, beta=BETA)
    want_c = [BETA * (C[i] - RC[i]) for i in range(3)]
    want_r = [BETA * (R[i] - RR[i]) for i in range(3)]
    torch.testing.assert_close(out.chosen_rewards, torch.tensor(want_c, dtype=torch.float64))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor(want_r, dtype=torch.float64))
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad
    assert out.losses.requires_grad


def test_weighted_combination_is_the_weighted_sum():
    types, weights = ["sigmoid", "sft", "bco_pair", "aot_pair"], [0.8, 0.2, 1.5, 0.3]
    out = dpo_losses(*inputs(), loss_type=types, loss_weights=weights, **KW)
    want = sum(w * expected(t) for t, w in zip(types, weights))
    torch.testing.assert_close(out.losses, want)
    plain = dpo_losses(*inputs(), loss_type=["sigmoid", "ipo"], **KW).losses
    torch.testing.assert_close(plain, expected("sigmoid") + expected("ipo"))


def test_reference_free_is_zero_reference_logps():
    c, r, _, _ = inputs()
    zeros = torch.zeros(3, dtype=torch.float64)
    out = dpo_losses(c, r, zeros, zeros, beta=BETA)
    want = [-logsig(BETA * (C[i] - R[i])) for i in range(3)]
    torch.testing.assert_close(out.losses, torch.tensor(want, dtype=torch.float64))
    torch.testing.assert_close(out.chosen_rewards, BETA * c)


def test_sigmoid_gradient_matches_the_analytic_one():
    c, r, rc, rr = inputs(requires_grad=True)
    dpo_losses(c, r, rc, rr, beta=BETA).losses.sum().backward()
    g = [-BETA * (1 - sig(BETA * ((C[i] - RC[i]) - (R[i] - RR[i])))) for i in range(3)]
    g = torch.tensor(g, dtype=torch.float64)
    torch.testing.assert_close(c.grad, g)
    torch.testing.assert_close(r.grad, -g)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sigmoid_norm", "exo_pair", "discopop", "nca_pair",
                                       "apo_down", ["robust", "sft", "aot"]])
def test_gradcheck(loss_type):
    c, r, _, _ = inputs(requires_grad=True)
    rc, rr = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (RC, RR))

    def fn(*t):
        return dpo_losses(*t, loss_type=loss_type, **KW).losses

    assert torch.autograd.gradcheck(fn, (c, r, rc, rr))


@pytest.mark.parametrize("loss_type", sorted(DPO_LOSSES))
def test_batch_without_tokens_stays_connected(loss_type):
    # Per-token log-probs of a micro-batch whose completions were all truncated away.
    token_logps = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    logps = (token_logps * torch.zeros(6, 4, dtype=torch.float64)).sum(-1)  # [2B] of zeros
    lengths = torch.zeros(3)
    kw = {**KW, "chosen_lengths": lengths, "rejected_lengths": lengths}
    out = dpo_losses(logps[:3], logps[3:], logps[:3].detach(), logps[3:].detach(),
                     loss_type=loss_type, **kw)
    loss = out.losses.sum() / 3
    assert torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    assert torch.equal(token_logps.grad, torch.zeros_like(token_logps))


@pytest.mark.parametrize("loss_type", sorted(DPO_LOSSES))
def test_empty_batch_stays_connected(loss_type):
    c = torch.zeros(0, requires_grad=True)
    kw = {**KW, "chosen_lengths": torch.zeros(0), "rejected_lengths": torch.zeros(0)}
    out = dpo_losses(c, c, c.detach(), c.detach(), loss_type=loss_type, **kw)
    loss = out.losses.sum()
    assert loss.item() == 0 and loss.requires_grad
    loss.backward()
    assert c.grad is not None and c.grad.shape == (0,)


@pytest.mark.parametrize("loss_type", sorted(set(DPO_LOSSES) - BATCH_COUPLED_LOSSES))
def test_global_normalisation_does_not_depend_on_the_split(loss_type):
    # sft's token mean is over the whole step: the trainer passes the step's tokens per pair.
    step = {"sft_tokens_per_pair": sum(LC) / 3}
    whole = dpo_losses(*inputs(), loss_type=loss_type, **KW, **step).losses.sum() / 3
    parts = []
    for idx in ([0], [1, 2]):
        kw = {**KW, **step, "chosen_lengths": torch.tensor(LC)[idx],
              "rejected_lengths": torch.tensor(LR)[idx]}
        part = dpo_losses(*(t[idx] for t in inputs()), loss_type=loss_type, **kw).losses
        parts.append(part.sum() / 3)
    torch.testing.assert_close(parts[0] + parts[1], whole)


def test_aot_is_batch_dependent_as_documented():
    whole = dpo_losses(*inputs(), loss_type="aot", beta=BETA).losses.sum()
    parts = sum(dpo_losses(*(t[idx] for t in inputs()), loss_type="aot", beta=BETA).losses.sum()
                for idx in ([0, 1], [2]))
    assert not torch.allclose(whole, parts)


def test_sft_is_the_token_mean_over_chosen_tokens_as_trl():
    want = torch.tensor(-sum(C) / sum(LC), dtype=torch.float64)
    for lengths in (torch.tensor(LC), torch.tensor(sum(LC) / 3, dtype=torch.float64)):  # per pair, or one average
        out = dpo_losses(*inputs(), loss_type="sft", chosen_lengths=lengths)
        torch.testing.assert_close(out.losses.sum() / 3, want)
    # Over an optimizer step: the step's tokens per pair, whatever the micro-batch holds.
    from fusedalign.losses import DPOOptions, PairLogps, pair_losses

    step = DPOOptions(sft_tokens_per_pair=torch.tensor(4.0, dtype=torch.float64))
    part = pair_losses(PairLogps(*inputs(), torch.tensor(LC), torch.tensor(LR)), [("sft", 1.0)], step).losses
    torch.testing.assert_close(part, -torch.tensor(C, dtype=torch.float64) / 4)


def test_float32_inputs_give_float32_losses():
    out = dpo_losses(*inputs(torch.float32), loss_type=sorted(DPO_LOSSES), **KW)
    assert out.losses.dtype == torch.float32 and torch.isfinite(out.losses).all()


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="dpo"), r"Unknown DPO loss_type.*'sigmoid'"),
    (dict(loss_type=["sigmoid", "nope"]), r"'nope'.*valid"),
    (dict(loss_type=[]), "Unknown DPO loss_type"),
    (dict(beta=0.0), "beta"),
    (dict(beta=-0.1), "beta"),
    (dict(beta=float("nan")), "beta"),
    (dict(label_smoothing=-0.1), "label_smoothing"),
    (dict(label_smoothing=0.6), "label_smoothing"),
    (dict(loss_type="robust", label_smoothing=0.5), "robust"),
    (dict(loss_type="exo_pair"), "exo_pair"),
    (dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0]), "loss_weights"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpo_losses(*inputs(), **kwargs)
    with pytest.raises(ValueError, match=match):
        check_dpo_args(kwargs.get("loss_type", "sigmoid"), beta=kwargs.get("beta", 0.1),
                       label_smoothing=kwargs.get("label_smoothing", 0.0),
                       loss_weights=kwargs.get("loss_weights"))


@pytest.mark.parametrize("loss_type, name", [("ipo", "chosen_lengths"), ("sft", "chosen_lengths"),
                                             ("sigmoid_norm", "chosen_lengths")])
def test_length_normalised_types_need_lengths(loss_type, name):
    with pytest.raises(ValueError, match=name):
        dpo_losses(*inputs(), loss_type=loss_type)
    for paired in ("ipo", "sigmoid_norm"):
        with pytest.raises(ValueError, match="rejected_lengths"):
            dpo_losses(*inputs(), loss_type=paired, chosen_lengths=torch.tensor(LC))


def test_check_dpo_args_returns_the_plan():
    plan = check_dpo_args(["sigmoid", "sft"], beta=0.1, loss_weights=[1, 0.5])
    assert plan == [("sigmoid", 1.0), ("sft", 0.5)]
    assert check_dpo_args("ipo", beta=0.1) == [("ipo", 1.0)]


def test_metrics_are_sums_that_reduce_over_ranks():
    cr = torch.tensor([0.5, -0.2, 0.1, 0.0])
    rr = torch.tensor([0.1, 0.3, -0.4, 0.0])  # last pair ties: not counted as accurate
    cl, rl = torch.tensor([-1.0, -2.0, -3.0, -4.0]), torch.tensor([-5.0, -6.0, -7.0, -8.0])
    metrics = dpo_metrics(cr, rr, cl, rl)
    m = metrics.logged()
    assert m["rewards/chosen"] == pytest.approx(0.1)
    assert m["rewards/rejected"] == pytest.approx(0.0, abs=1e-7)  # fp32 inputs summed in fp64
    assert m["rewards/accuracies"] == pytest.approx(0.5)
    assert m["rewards/margins"] == pytest.approx(0.1)
    assert m["logps/chosen"] == pytest.approx(-2.5) and m["logps/rejected"] == pytest.approx(-6.5)
    # Two "ranks" of unequal size, reduced into one window, give the same means.
    ranks = [dpo_metrics(cr[i], rr[i], cl[i], rl[i]) for i in (slice(0, 1), slice(1, None))]
    assert logged_values(*ranks) == pytest.approx(m, abs=1e-6)
    # A pair with nothing to score counts nowhere.
    masked = dpo_metrics(cr, rr, cl, rl, valid=torch.tensor([True, True, True, False])).logged()
    assert masked["logps/chosen"] == pytest.approx(-2.0) and masked["rewards/accuracies"] == pytest.approx(2 / 3)
    assert all(not t.requires_grad for _, stat in metrics.stats() for t in (stat.sum, stat.count))


def test_bco_reward_mean():
    stats = bco_reward_mean(torch.tensor([1.0, 2.0]), torch.tensor([3.0, -4.0]))
    assert stats.sum.item() == 2.0 and stats.count.item() == 4.0 and stats.mean.item() == 0.5
