"""On CUDA, padding-free preference rows attend through flex attention by default; a dense
implementation asked for is kept, and for large rows one line names its cost and the way out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fusedalign.attention import selection
from fusedalign.attention.selection import ATTENTION_ASKED, DENSE_ROW_LIMIT, dense_row_cost, packed_attention, row_tokens
from fusedalign.models import load_model
from fusedalign.trainers.preference_inputs import check_models

BIG = DENSE_ROW_LIMIT + 1


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention", "flash_attention_2"])
def test_the_cpu_keeps_every_implementation_and_says_nothing(implementation):
    for asked in (True, False):
        assert packed_attention(implementation, on_cuda=False, flex_available=True, asked=asked) == implementation
    assert dense_row_cost(implementation, on_cuda=False, flex_available=True, tokens=None) is None


def test_a_default_dense_implementation_moves_to_flex_on_cuda():
    for dense in ("sdpa", "eager"):
        assert packed_attention(dense, on_cuda=True, flex_available=True, asked=False) == "flex_attention"


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2", "flash_attention_3"])
def test_a_segment_aware_implementation_is_kept_on_cuda_and_costs_nothing(implementation):
    for asked in (True, False):
        assert packed_attention(implementation, on_cuda=True, flex_available=True, asked=asked) == implementation
    assert dense_row_cost(implementation, on_cuda=True, flex_available=True, tokens=None) is None


def test_a_dense_implementation_asked_for_is_kept_and_its_cost_named_above_the_limit():
    assert packed_attention("sdpa", on_cuda=True, flex_available=True, asked=True) == "sdpa"
    assert dense_row_cost("sdpa", on_cuda=True, flex_available=True, tokens=DENSE_ROW_LIMIT) is None
    for tokens in (BIG, None):
        line = dense_row_cost("sdpa", on_cuda=True, flex_available=True, tokens=tokens)
        assert "\n" not in line and "--attn_implementation flex_attention" in line and "--max_tokens_per_batch" in line


def test_without_flex_a_default_sdpa_is_kept_and_the_way_out_says_what_flex_needs():
    assert packed_attention("sdpa", on_cuda=True, flex_available=False, asked=False) == "sdpa"
    assert "flex_attention (PyTorch >= 2.5)" in dense_row_cost("sdpa", on_cuda=True, flex_available=False, tokens=BIG)


def test_row_tokens_bound_a_packed_micro_batch():
    args = SimpleNamespace(max_tokens_per_batch=None, per_device_train_batch_size=8, max_length=1024,
                           pad_to_multiple_of=None)
    assert row_tokens(args) == 2 * 8 * 1024
    args.max_tokens_per_batch, args.pad_to_multiple_of = 3000, 1024
    assert row_tokens(args) == 3072
    args.max_tokens_per_batch, args.max_length = None, None
    assert row_tokens(args) is None


def test_load_model_records_whether_an_implementation_was_asked_for():
    assert getattr(load_model("builtin:tiny-qwen2"), ATTENTION_ASKED) is False
    assert getattr(load_model("builtin:tiny-qwen2", attn_implementation="sdpa"), ATTENTION_ASKED) is True


def _args(**kw):
    base = dict(padding_free=True, share_prompt=False, max_tokens_per_batch=None, per_device_train_batch_size=8,
                max_length=1024, pad_to_multiple_of=None, use_cpu=False, process_index=0)
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture
def cuda(monkeypatch):
    """The decision as on a CUDA machine with flex attention (no kernel runs here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(selection, "_flex_available", lambda: True)


def test_trainer_init_moves_default_policy_and_reference_to_flex(cuda, capsys):
    policy, reference = load_model("builtin:tiny-qwen2"), load_model("builtin:tiny-qwen2")
    check_models(_args(), policy, reference)
    assert policy.config._attn_implementation == reference.config._attn_implementation == "flex_attention"
    assert "attention runs on flex_attention, not sdpa" in capsys.readouterr().err


def test_trainer_init_keeps_what_was_asked_for_and_names_its_cost(cuda, capsys):
    small, reference = load_model("builtin:tiny-qwen2", attn_implementation="sdpa"), load_model("builtin:tiny-qwen2")
    capsys.readouterr()
    check_models(_args(max_tokens_per_batch=1024), small, reference)
    assert small.config._attn_implementation == reference.config._attn_implementation == "sdpa"
    assert capsys.readouterr().err == ""
    large = load_model("builtin:tiny-qwen2", attn_implementation="eager")
    capsys.readouterr()
    check_models(_args(), large)
    assert large.config._attn_implementation == "eager"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "attention implementation 'eager'" in err and "up to 16,384 tokens" in err


def test_padded_rows_are_left_alone(cuda):
    policy = load_model("builtin:tiny-qwen2")
    check_models(_args(padding_free=False), policy)
    assert policy.config._attn_implementation == "sdpa"
