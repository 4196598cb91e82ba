"""SFT loss and metrics against hand-computed values."""

import pytest
import torch

from fusedalign.losses import sft_loss, sft_metrics
from fusedalign.metrics import logged_values

LOGPS = torch.tensor([[-0.5, -1.0, -2.0, -4.0], [-0.25, -3.0, -8.0, -0.125]]).double()
MASK = torch.tensor([[False, True, True, False], [True, True, True, True]])


def test_value_is_minus_masked_sum_over_the_global_count():
    # Scored: -1 -2 | -0.25 -3 -8 -0.125: sum -14.375; global count 10 (other ranks hold 4).
    assert sft_loss(LOGPS, MASK, 10).item() == pytest.approx(1.4375)
    assert sft_loss(LOGPS, MASK, torch.tensor(6)).item() == pytest.approx(14.375 / 6)
    assert sft_loss(LOGPS.flatten(), MASK.flatten(), 6).item() == pytest.approx(14.375 / 6)
    assert sft_loss(LOGPS, MASK.long(), 6).item() == pytest.approx(14.375 / 6)


def test_gradient_is_minus_mask_over_count():
    logps = LOGPS.clone().requires_grad_(True)
    sft_loss(logps, MASK, 10).backward()
    torch.testing.assert_close(logps.grad, -MASK.double() / 10)


def test_split_over_micro_batches_equals_one_batch():
    n = int(MASK.sum())
    whole = sft_loss(LOGPS, MASK, n)
    parts = sft_loss(LOGPS[:1], MASK[:1], n) + sft_loss(LOGPS[1:], MASK[1:], n)
    torch.testing.assert_close(parts, whole)


def test_nothing_to_learn_is_zero_and_connected():
    logps = LOGPS.clone().requires_grad_(True)
    loss = sft_loss(logps, torch.zeros_like(MASK), 10)
    assert loss.item() == 0 and loss.requires_grad
    loss.backward()
    assert torch.equal(logps.grad, torch.zeros_like(logps))
    # A global batch with no tokens at all: still 0, not NaN.
    assert sft_loss(logps, torch.zeros_like(MASK), 0).item() == 0


def test_masked_positions_may_hold_anything():
    logps = LOGPS.clone()
    logps[0, 0] = float("-inf")
    logps[0, 3] = float("nan")
    logps.requires_grad_(True)
    loss = sft_loss(logps, MASK, 6)
    loss.backward()
    assert loss.item() == pytest.approx(14.375 / 6)
    assert torch.isfinite(logps.grad).all() and logps.grad[0, 0] == 0


def test_gradcheck():
    logps = LOGPS.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: sft_loss(x, MASK, 7), (logps,))


def test_metrics_are_sums_over_scored_tokens():
    match = torch.tensor([[True, True, False, True], [False, True, True, True]])
    entropy = torch.tensor([[9.0, 1.0, 2.0, 9.0], [0.5, 1.5, 3.0, 4.0]])
    m = sft_metrics(MASK, match, entropy)
    assert m.accuracy.count.sum().item() == 6 and m.accuracy.sum.sum().item() == 4
    assert m.entropy.sum.sum().item() == 12.0
    means = m.logged()
    assert means["mean_token_accuracy"] == pytest.approx(4 / 6)
    assert means["entropy"] == pytest.approx(2.0)
    ranks = [sft_metrics(MASK[i:i + 1], match[i:i + 1], entropy[i:i + 1]) for i in (0, 1)]
    assert logged_values(*ranks) == pytest.approx(means)
    # A padding-free row holding both examples gives the same per-example values.
    examples = torch.tensor([[0] * 4 + [1] * 4])
    flat = sft_metrics(MASK.reshape(1, 8), match.reshape(1, 8), entropy.reshape(1, 8), examples)
    torch.testing.assert_close(flat.accuracy.sum, m.accuracy.sum.double())
    torch.testing.assert_close(flat.entropy.count, m.entropy.count.double())


def test_metrics_without_statistics_or_tokens():
    m = sft_metrics(MASK)
    assert m.accuracy.sum.sum().item() == 0 and m.entropy is None
    # Nothing scored: nothing is logged (a mean over no token is not 0).
    empty = sft_metrics(torch.zeros(2, 3, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool))
    assert empty.logged() == {}
