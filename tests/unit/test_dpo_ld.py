"""LD-DPO (`ld_alpha`): each row layout's cut at the pair's shared length against a hand computation
of TRL 1.16's masks; the loss on the weighted sums (sft on the plain ones); and DPO training with
it: fused = unfused, packed rows = padded rows, 1.0 = None exactly, and not the run without it.
f-DPO in training (fused = unfused, not reverse_kl's run) and both options' config checks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fusedalign.configs import DPOConfig
from fusedalign.data import DPOCollator
from fusedalign.data.packed_rows import IGNORE_INDEX, PackedRows
from fusedalign.data.preference_batches import PackedDPOCollator
from fusedalign.data.shared_length import SharedLengthSplit
from fusedalign.losses import DPOOptions, check_dpo_args, dpo_batch_loss, ld_weighted
from fusedalign.metrics import logged_values
from tests.unit.test_dpo_trainer import _assert_loss_aware_ran, _assert_same_training, _edge_rows, _run

# (prompt, chosen, rejected) token counts: uneven both ways, equal, a one-token completion, no prompt.
SHAPES = [(3, 3, 5), (2, 6, 2), (4, 4, 4), (1, 1, 6), (0, 3, 2)]
ALPHA = 0.5


def _pairs() -> list[dict]:
    """Token ids that name their sequence and completion position: chosen of pair i at position k
    is 1000 + 100 i + k, rejected 2000 + 100 i + k; prompt tokens are 7."""
    return [dict(prompt_ids=[7] * p, chosen_ids=[1000 + 100 * i + k for k in range(c)],
                 rejected_ids=[2000 + 100 * i + k for k in range(r)]) for i, (p, c, r) in enumerate(SHAPES)]


def _token_logp(token: int) -> float:
    return -token / 997.0


def _hand(alpha: float) -> tuple[list[float], list[float]]:
    """TRL's LD sums of each sequence [2B] (chosen, then rejected), and the plain sums: the scored
    completion position k (1-based) weighs 1 up to min(|y_w|, |y_l|) scored tokens, alpha past it.
    Without a prompt a completion's first token has nothing before it and is not scored (TRL's
    shifted completion mask)."""
    weighted, plain = [], []
    for role in (1000, 2000):
        for i, (p, c, r) in enumerate(SHAPES):
            first = 0 if p else 1
            n, shared = (c if role == 1000 else r), min(c, r) - first
            logps = [_token_logp(role + 100 * i + k) for k in range(first, n)]
            weighted.append(sum(logps[:shared]) + alpha * sum(logps[shared:]))
            plain.append(sum(logps))
    return weighted, plain


LAYOUTS = {
    "padded": lambda rows: PackedRows.from_collated(DPOCollator(0)(rows), packed=False, per_group=2),
    "padding_free": lambda rows: PackedRows.from_collated(PackedDPOCollator(0)(rows), packed=True),
    "shared_prompt": lambda rows: PackedRows.from_collated(PackedDPOCollator(0, share_prompt=True)(rows),
                                                           packed=True),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_cut_of_each_layout_is_trls_masks(layout):
    rows = LAYOUTS[layout](_pairs())
    # The log-prob of each scored position is a function of its label, the token it scores.
    values = torch.where(rows.labels != IGNORE_INDEX, -rows.labels.double() / 997.0, 0.0)
    split = SharedLengthSplit.of(rows)
    parts = split.sums(values)  # [4B]
    weighted, plain = ld_weighted(parts, ALPHA)
    want_weighted, want_plain = _hand(ALPHA)
    torch.testing.assert_close(weighted, torch.tensor(want_weighted, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(plain, torch.tensor(want_plain, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(plain, rows.sums(values), rtol=1e-12, atol=1e-12)
    b = len(SHAPES)
    tails = parts[2 * b:]
    # Equal lengths (pair 2): nothing past the shared length; the shorter side never has a tail;
    # a one-token chosen (pair 3): its rejected keeps one token in the shared part.
    assert tails[2] == 0 and tails[b + 2] == 0
    assert tails[0] == 0 and tails[b + 1] == 0 and tails[3] == 0 and tails[b + 4] == 0
    assert parts[b + 3] == _token_logp(2000 + 300)
    assert split.groups.tolist() == rows.sequence_group.tolist() * 2


def test_alpha_zero_and_one():
    rows = LAYOUTS["padded"](_pairs())
    values = torch.where(rows.labels != IGNORE_INDEX, -rows.labels.double() / 997.0, 0.0)
    parts = SharedLengthSplit.of(rows).sums(values)
    for alpha in (0.0, 1.0):
        torch.testing.assert_close(ld_weighted(parts, alpha).weighted, torch.tensor(_hand(alpha)[0],
                                   dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_the_loss_scores_the_weighted_sums_and_sft_every_token():
    """Every loss type reads the weighted sums (and so do the logged logps and rewards); the sft term
    is TRL's token mean over every chosen token, the plain sums."""
    b = len(SHAPES)
    parts = torch.linspace(-9.0, -0.5, 4 * b, dtype=torch.float64)
    weighted, plain = ld_weighted(parts, ALPHA)
    ref = torch.linspace(-7.0, -1.0, 2 * b, dtype=torch.float64)
    lengths = torch.tensor([c for _, c, _ in SHAPES] + [r for _, _, r in SHAPES])
    opts = DPOOptions(beta=0.5, sft_tokens_per_pair=torch.tensor(3.0, dtype=torch.float64))
    dpo = check_dpo_args(["sigmoid", "ipo", "apo_zero"], beta=0.5)
    got, got_metrics = dpo_batch_loss(parts, ref, lengths, dpo, opts, ld_alpha=ALPHA)
    want, want_metrics = dpo_batch_loss(weighted, ref, lengths, dpo, opts)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert logged_values(got_metrics) == logged_values(want_metrics)
    sft, _ = dpo_batch_loss(parts, ref, lengths, check_dpo_args("sft", beta=0.5), opts, ld_alpha=ALPHA)
    torch.testing.assert_close(sft, -plain[:b].sum() / 3.0, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ training

def _assert_exactly_equal(got, want):
    (got_logs, got_weights, _), (want_logs, want_weights, _) = got, want
    assert got_logs == want_logs
    assert all(torch.equal(got_weights[k], v) for k, v in want_weights.items())


@pytest.fixture(scope="module")
def unfused_padded(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ld-padded"), _edge_rows(), fused_head=False, ld_alpha=ALPHA)


def test_training_with_ld_alpha_fused_equals_unfused_and_differs_from_plain_dpo(tmp_path, unfused_padded):
    calls = Counter()
    fused = _run(tmp_path / "fused", _edge_rows(), calls=calls, fused_head=True, ld_alpha=ALPHA)
    _assert_loss_aware_ran(calls, steps=2)  # the head declared the parts' loss and it matched
    _assert_same_training(fused, unfused_padded, steps=2)
    plain = _run(tmp_path / "plain", _edge_rows(), fused_head=False)
    # Step 1's loss is log 2 either way (policy = reference); the logged log-probs and step 2 differ.
    assert abs(plain[0][0]["logps/chosen"] - unfused_padded[0][0]["logps/chosen"]) > 1.0
    assert abs(plain[0][1]["loss"] - unfused_padded[0][1]["loss"]) > 1e-4


@pytest.mark.parametrize("layout", ["padding_free", "shared_prompt"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_packed_rows_with_ld_alpha_train_like_padded_rows(tmp_path, unfused_padded, layout, fused):
    packed = dict(padding_free=True, share_prompt=layout == "shared_prompt")
    calls = Counter()
    got = _run(tmp_path, _edge_rows(), calls=calls, fused_head=fused, ld_alpha=ALPHA, **packed)
    _assert_same_training(got, unfused_padded, steps=2)
    if fused:
        _assert_loss_aware_ran(calls, steps=2)


def test_a_precomputed_reference_is_weighted_the_same(tmp_path, unfused_padded):
    got = _run(tmp_path, _edge_rows(), fused_head=False, ld_alpha=ALPHA, precompute_ref_log_probs=True)
    # Step 1 is a tie: the policy is the reference, so one pass gives every reward exactly 0, and the
    # reference precomputed in a pass of its own gives sums within rounding of the policy's, either
    # side (on some CPUs -7.9e-8). rewards/accuracies counts margins > 0 (TRL's strict comparison), so
    # at a tie it counts rounding. Step 1's accuracy is held to the tie itself, every reward within
    # rounding of 0; everything else, step 2's accuracy included, to _assert_same_training's 1e-5.
    (logs, weights, trainer), want = got, unfused_padded[0]
    assert want[0]["rewards/chosen"] == want[0]["rewards/rejected"] == want[0]["rewards/accuracies"] == 0.0
    assert max(abs(logs[0][k]) for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")) < 1e-6, logs[0]
    logs = [{**logs[0], "rewards/accuracies": want[0]["rewards/accuracies"]}, *logs[1:]]
    _assert_same_training((logs, weights, trainer), unfused_padded, steps=2)


def test_ld_alpha_one_is_no_weighting_exactly(tmp_path):
    one = _run(tmp_path / "one", _edge_rows(), ld_alpha=1.0, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    none = _run(tmp_path / "none", _edge_rows(), loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    _assert_exactly_equal(one, none)


def test_the_config_refuses_a_divergence_a_loss_type_lacks_and_ld_alpha_out_of_range(tmp_path):
    with pytest.raises(ValueError, match=r"f_divergence_type='js_divergence' needs loss types built on the "
                                         r"chosen-rejected reward difference \(discopop, .*\); loss_type \['apo_zero'\]"):
        DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "apo_zero"], f_divergence_type="js_divergence")
    with pytest.raises(ValueError, match="f_divergence_type must be one of 'reverse_kl', 'forward_kl', "
                                         "'js_divergence', 'alpha_divergence'; got 'kl'"):
        DPOConfig(output_dir=str(tmp_path), f_divergence_type="kl")
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=rf"ld_alpha must lie in \[0, 1\].*got {bad}"):
            DPOConfig(output_dir=str(tmp_path), ld_alpha=bad)
    args = DPOConfig(output_dir=str(tmp_path), loss_type=["ipo", "sft"], f_divergence_type="alpha_divergence",
                     f_alpha_divergence_coef=0.3)
    opts = args.loss_options()
    assert (opts.f_divergence_type, opts.f_alpha_divergence_coef) == ("alpha_divergence", 0.3)
    assert [DPOConfig(output_dir=str(tmp_path), ld_alpha=a).ld_weight for a in (None, 1.0, 0.0, 0.5)] == \
        [None, None, 0.0, 0.5]


@pytest.mark.parametrize("loss_type,divergence", [("ipo", "alpha_divergence"), ("discopop", "js_divergence")])
def test_training_with_an_f_divergence_fused_equals_unfused_and_differs_from_reverse_kl(tmp_path, loss_type,
                                                                                       divergence):
    """The loss-aware head declares the f-DPO loss (its gradient matched in backward), the unfused path
    computes the same; and the divergence changes the training (at step 1 every score is 0, as the
    policy is the reference, but js_divergence's slope there is 1/2: another gradient; step 2's loss)."""
    f = dict(loss_type=[loss_type], f_divergence_type=divergence, f_alpha_divergence_coef=0.3, ld_alpha=ALPHA)
    calls = Counter()
    fused = _run(tmp_path / "fused", _edge_rows(), calls=calls, fused_head=True, **f)
    unfused = _run(tmp_path / "unfused", _edge_rows(), fused_head=False, **f)
    _assert_loss_aware_ran(calls, steps=2)
    _assert_same_training(fused, unfused, steps=2)
    reverse = _run(tmp_path / "reverse", _edge_rows(), fused_head=False, loss_type=[loss_type], ld_alpha=ALPHA)
    if divergence == "js_divergence":
        assert unfused[0][0]["grad_norm"] == pytest.approx(reverse[0][0]["grad_norm"] / 2, rel=1e-4)
    else:
        assert abs(reverse[0][1]["loss"] - unfused[0][1]["loss"]) > 1e-4
