"""WPO (`use_weighting`): the weights and the weighted per-pair losses against TRL 1.16's formula,
written out here per token in float64: aligned = (logp - log sum p^2) * mask, w = exp(sum / max(len, 1)),
each pair's loss times w_chosen * w_rejected, the batch's mean. And the config's checks."""

import math

import pytest
import torch

from fusedalign.configs import DPOConfig
from fusedalign.losses import DPOOptions, check_dpo_args, dpo_batch_loss, wpo_weights

BETA = 0.5
# Per-token values of 3 pairs (chosen rows, then rejected), completion lengths 3, 1, 4 / 2, 5, 1.
LC, LR = [3, 1, 4], [2, 5, 1]
LENGTHS = LC + LR
T = max(LENGTHS)


def _tokens(seed: int, low: float, high: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand(len(LENGTHS), T, generator=g, dtype=torch.float64)


LOGP = _tokens(0, -4.0, -0.05)  # [2B, T] policy token log-probs
LSS = _tokens(1, -3.0, -0.2)  # [2B, T] log sum_v p_v^2 at each position
MASK = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS], dtype=torch.float64)
REF = torch.tensor([-5.0, -2.9, -6.5, -3.1, -7.2, -1.0], dtype=torch.float64)  # [2B] reference sums


def _trl_weights() -> list[float]:
    """[B] w_c * w_r, one pair at a time, as TRL's `use_weighting` branch."""
    w = []
    for s in range(len(LENGTHS)):
        n = sum(MASK[s].tolist())
        aligned = sum((LOGP[s, t] - LSS[s, t]).item() * MASK[s, t].item() for t in range(T))
        w.append(math.exp(aligned / max(n, 1.0)))
    b = len(LC)
    return [w[i] * w[b + i] for i in range(b)]


def _trl_loss(loss_type: str) -> float:
    """TRL's per_sequence_loss for each pair, times its weight, mean over the pairs."""
    b = len(LC)
    seq = (LOGP * MASK).sum(1).tolist()
    out = []
    for i, w in enumerate(_trl_weights()):
        cw, cl = seq[i] - REF[i].item(), seq[b + i] - REF[b + i].item()
        h = cw - cl
        if loss_type == "sigmoid":
            v = math.log1p(math.exp(-BETA * h))
        elif loss_type == "hinge":
            v = max(0.0, 1 - BETA * h)
        elif loss_type == "ipo":
            v = (cw / LC[i] - cl / LR[i] - 1 / (2 * BETA)) ** 2
        elif loss_type == "apo_zero":
            v = (1 - 1 / (1 + math.exp(-BETA * cw))) + 1 / (1 + math.exp(-BETA * cl))
        out.append(v * w)
    return sum(out) / b


def _ours(loss_types, weights=None, opts=DPOOptions(beta=BETA), use_weighting=True):
    seq = (LOGP * MASK).sum(1)
    plan = check_dpo_args(loss_types, beta=BETA, loss_weights=weights)
    lengths = torch.tensor(LENGTHS)
    w = wpo_weights(((LOGP - LSS) * MASK).sum(1), lengths) if use_weighting else None
    loss_sum, _ = dpo_batch_loss(seq, REF, lengths, plan, opts, pair_weights=w)
    return loss_sum / len(LC)


def test_the_weights_are_trls():
    got = wpo_weights(((LOGP - LSS) * MASK).sum(1), torch.tensor(LENGTHS))
    torch.testing.assert_close(got, torch.tensor(_trl_weights(), dtype=torch.float64), rtol=1e-13, atol=0)
    assert got.std() > 0.05  # not a constant factor the loss could hide


def test_an_empty_completion_weighs_one_and_the_weights_carry_no_gradient():
    sums = torch.tensor([0.0, -1.2, 0.0, -0.8], dtype=torch.float64, requires_grad=True)
    w = wpo_weights(sums, torch.tensor([0, 3, 0, 2]))
    assert not w.requires_grad
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-0.4 - 0.4)], dtype=torch.float64))


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "apo_zero"])
def test_each_pairs_loss_is_weighted_as_trl_weighs_it(loss_type):
    torch.testing.assert_close(_ours([loss_type]), torch.tensor(_trl_loss(loss_type), dtype=torch.float64),
                               rtol=1e-12, atol=1e-14)
    assert abs(_ours([loss_type]).item() - _ours([loss_type], use_weighting=False).item()) > 1e-4


def test_a_mix_weighs_each_type_and_sft_per_pair():
    """TRL multiplies each type's per-pair loss by the weight (the same as weighing the weighted
    sum); the sft term here is each pair's share of the token mean times that pair's weight
    (TRL: the batch's token mean times the mean weight; see the README's differences)."""
    got = _ours(["sigmoid", "ipo"], [1.0, 0.3])
    torch.testing.assert_close(got, torch.tensor(_trl_loss("sigmoid") + 0.3 * _trl_loss("ipo"), dtype=torch.float64),
                               rtol=1e-12, atol=1e-14)
    per_pair = sum(LC) / len(LC)
    sft = _ours(["sft"], opts=DPOOptions(beta=BETA, sft_tokens_per_pair=per_pair))
    chosen = (LOGP * MASK).sum(1)[: len(LC)].tolist()
    want = sum(-c / per_pair * w for c, w in zip(chosen, _trl_weights())) / len(LC)
    assert sft.item() == pytest.approx(want, rel=1e-12)


def test_without_weighting_nothing_changes():
    for types in (["sigmoid"], ["ipo", "hinge"]):
        seq, lengths = (LOGP * MASK).sum(1), torch.tensor(LENGTHS)
        plan = check_dpo_args(types, beta=BETA)
        plain, _ = dpo_batch_loss(seq, REF, lengths, plan, DPOOptions(beta=BETA))
        ones, _ = dpo_batch_loss(seq, REF, lengths, plan, DPOOptions(beta=BETA),
                                 pair_weights=torch.ones(len(LC), dtype=torch.float64))
        assert torch.equal(plain, ones)


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired", "aot_pair"])
def test_the_config_refuses_the_sorting_loss_types(tmp_path, loss_type):
    with pytest.raises(ValueError, match=rf"use_weighting=True \(WPO\) .* loss_type \['{loss_type}'\] sorts the "
                                         r"pairs across the batch"):
        DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", loss_type], use_weighting=True)
    assert DPOConfig(output_dir=str(tmp_path), loss_type=[loss_type]).use_weighting is False
    assert DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "bco_pair"], use_weighting=True).use_weighting
