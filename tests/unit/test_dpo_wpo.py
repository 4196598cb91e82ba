"""DPO training with WPO's `use_weighting`: fused = unfused (the per-token head: the loss-aware head
stays off, the weights coming from the same forward), padding-free and shared-prompt rows = padded
rows, and not the run without it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.unit.test_dpo_trainer import _assert_same_training, _edge_rows, _run


@pytest.fixture(scope="module")
def unfused_padded(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("wpo-padded"), _edge_rows(), fused_head=False, use_weighting=True)


def test_fused_equals_unfused_on_the_per_token_head_and_differs_from_plain_dpo(tmp_path, unfused_padded):
    calls = Counter()
    fused = _run(tmp_path / "fused", _edge_rows(), calls=calls, fused_head=True, use_weighting=True)
    assert calls["forward"] == 0, calls  # the loss-aware head never ran
    assert fused[2].args.loss_aware_head  # though it was not turned off
    _assert_same_training(fused, unfused_padded, steps=2)
    plain = _run(tmp_path / "plain", _edge_rows(), fused_head=False)
    # Policy = reference at step 1: plain DPO's loss is log 2, WPO's log 2 times the mean weight.
    assert plain[0][0]["loss"] == pytest.approx(0.6931472, abs=1e-6)
    for step in range(2):
        assert abs(plain[0][step]["loss"] - unfused_padded[0][step]["loss"]) > 1e-3
    assert any(not torch.allclose(plain[1][k], v, rtol=1e-4, atol=1e-6) for k, v in unfused_padded[1].items())


@pytest.mark.parametrize("layout", ["padding_free", "shared_prompt"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_packed_rows_with_weighting_train_like_padded_rows(tmp_path, unfused_padded, layout, fused):
    packed = dict(padding_free=True, share_prompt=layout == "shared_prompt")
    got = _run(tmp_path, _edge_rows(), fused_head=fused, use_weighting=True, **packed)
    _assert_same_training(got, unfused_padded, steps=2)


def test_with_ld_alpha_and_a_mix_fused_equals_unfused(tmp_path):
    """Both weightings at once: the weights take every token once, whatever LD-DPO weighs."""
    options = dict(use_weighting=True, ld_alpha=0.5, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    fused = _run(tmp_path / "fused", _edge_rows(), fused_head=True, padding_free=True, share_prompt=True, **options)
    unfused = _run(tmp_path / "unfused", _edge_rows(), fused_head=False, **options)
    _assert_same_training(fused, unfused, steps=2)
