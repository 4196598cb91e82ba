"""attention_inputs: what each implementation is given, the masks, the refusals, and controls
showing that the parity tests (test_preference_batches.py) would see a leak."""

from __future__ import annotations

import copy

import pytest
import torch

from fusedalign.attention import PackedAttentionError, attention_inputs, block_mask, layer_windows, visibility
from fusedalign.data.preference_batches import preference_batch
from fusedalign.head import FLEX_KERNEL_OPTIONS, flex_kernel_options, forward_inputs, token_logprobs
from fusedalign.models import load_model
from tests.unit.test_preference_batches import ROWS, TOL, _model, _packed, _padded


def _per_sequence(model, batch, kwargs):
    """Log-probs of each sequence's scored tokens [S lists] from one forward with `kwargs`."""
    with torch.no_grad():
        logps = token_logprobs(model, kwargs, targets=batch["labels"]).logps[0]
    seq = batch["sequence_ids"][0]
    return [logps[seq == s] for s in range(batch["scored_tokens"].shape[0])]


def _padded_per_sequence(model, rows):
    with torch.no_grad():
        return [logps for _, logps in _padded(model, rows, True)[0]]


def _max_difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b) if x.numel())


# ------------------------------------------------------------------ what each implementation gets


def test_padding_free_rows_ride_on_position_ids_and_shared_rows_get_a_mask():
    rows = ROWS["uneven"]
    plain = preference_batch(rows)
    shared = preference_batch(rows, share_prompt=True)
    length = shared["input_ids"].shape[1]
    for attn in ("sdpa", "eager"):
        model = _model("qwen2", attn)
        assert set(attention_inputs(model, plain)) == {"input_ids", "position_ids"}
        mask = attention_inputs(model, shared)["attention_mask"]
        assert mask.shape == (1, 1, length, length)
        if attn == "sdpa":
            assert mask.dtype == torch.bool
        else:  # eager adds the mask to its scores
            assert mask.dtype == torch.float32 and set(mask.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}


def test_visibility_is_causal_attention_confined_to_the_prefix_tree():
    batch = preference_batch(ROWS["uneven"][:3] + ROWS["long"][:1], share_prompt=True, pad_to_multiple_of=16)
    seg, parent, pos = batch["segment_ids"][0], batch["parent_ids"][0], batch["position_ids"][0]
    for window in (None, 7):
        got = visibility(batch["segment_ids"], batch["parent_ids"], batch["position_ids"], window)[0, 0]
        length = seg.shape[0]
        want = torch.zeros(length, length, dtype=torch.bool)
        for q in range(length):
            for k in range(q + 1):
                related = seg[k] == seg[q] or seg[k] == parent[q]
                want[q, k] = related and (window is None or pos[q] - pos[k] < window)
        assert torch.equal(got, want)
    assert got.any(-1).all()  # every token sees at least itself (no fully masked row for sdpa)


def test_mixed_layer_types_get_a_mask_per_type_once_the_window_is_reached():
    model = _model("gemma2", "eager")
    assert layer_windows(model) == {"sliding_attention": 64, "full_attention": None}
    short = attention_inputs(model, preference_batch(ROWS["uneven"], share_prompt=True))
    assert torch.is_tensor(short["attention_mask"])  # no position reaches 64: one mask serves both types
    long = attention_inputs(model, preference_batch(ROWS["long"], share_prompt=True))["attention_mask"]
    assert set(long) == {"sliding_attention", "full_attention"}
    assert not torch.equal(long["sliding_attention"], long["full_attention"])


# ------------------------------------------------------------------ controls: the parity tests can fail


def test_control_a_padding_free_row_read_as_one_sequence_scores_differently():
    model = _model("llama", "sdpa")
    rows = ROWS["uneven"]
    batch = preference_batch(rows)
    expected = _padded_per_sequence(model, rows)
    assert _max_difference(_per_sequence(model, batch, attention_inputs(model, batch)), expected) < 1e-5
    leaky = {"input_ids": batch["input_ids"], "position_ids": torch.arange(batch["input_ids"].shape[1])[None]}
    assert _max_difference(_per_sequence(model, batch, leaky), expected) > 1e-3


def test_controls_a_shared_row_without_its_mask_or_with_a_duplicated_key_scores_differently():
    model = _model("qwen2", "sdpa")
    rows = ROWS["uneven"]
    expected = _padded_per_sequence(model, rows)
    batch = preference_batch(rows, share_prompt=True)
    right = _per_sequence(model, batch, attention_inputs(model, batch))
    assert _max_difference(right, expected) < 1e-5
    # Positions alone: transformers reads the rejected branch (continuing at p - 1) as a new
    # document that cannot see its prompt.
    positions_only = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    assert _max_difference(_per_sequence(model, batch, positions_only), expected) > 1e-3
    # The rejected branch also seeing the chosen branch's copy of the last prompt token: that
    # key twice in its softmax (a mask hiding only the chosen completion from it).
    mask = attention_inputs(model, batch)["attention_mask"].clone()
    seg, parent = batch["segment_ids"][0], batch["parent_ids"][0]
    for s in range(1, int(seg.max()) + 1):
        first = int((seg == s).nonzero()[0])
        siblings = (parent == parent[first]) & (parent >= 0) & (seg > s)
        mask[0, 0, siblings, first] = True
    assert _max_difference(_per_sequence(model, batch, dict(positions_only, attention_mask=mask)), expected) > 1e-3


def test_control_ignoring_the_sliding_window_scores_differently():
    model = _model("gemma2", "eager")
    rows = ROWS["long"]
    expected = _padded_per_sequence(model, rows)
    batch = preference_batch(rows, share_prompt=True)
    kwargs = attention_inputs(model, batch)
    assert _max_difference(_per_sequence(model, batch, kwargs), expected) < 1e-5
    no_window = dict(kwargs, attention_mask=kwargs["attention_mask"]["full_attention"])
    assert _max_difference(_per_sequence(model, batch, no_window), expected) > 1e-3


@pytest.mark.parametrize("share", [True, False])
def test_flex_attention_forward_on_a_packed_row_equals_the_padded_rows(share):
    """FlexAttention's forward runs on CPU (compiled by transformers); its backward does not (PyTorch
    refuses it there), so gradients through flex are for the GPU test. Shared-prompt and padding-free
    rows alike get our own BlockMask (transformers' builder from position_ids compiles per row length)."""
    from torch.nn.attention.flex_attention import BlockMask

    # transformers compiles flex attention; a second row length in one process recompiles it with
    # dynamic shapes, which inductor's CPU template fails to build (torch 2.13: "cur_qSplitSize4 was
    # not declared"). Each case starts from no compiled code, so each compiles for its own length.
    torch._dynamo.reset()
    model = load_model("builtin:tiny-qwen2", attn_implementation="flex_attention")
    rows = ROWS["uneven"]
    batch = preference_batch(rows, share_prompt=share)
    kwargs = attention_inputs(model, batch)
    assert isinstance(kwargs["attention_mask"], BlockMask)
    got = _per_sequence(model, batch, kwargs)
    assert _max_difference(got, _padded_per_sequence(_model("qwen2", "sdpa"), rows)) < TOL["atol"]
    # Control: the row under a mask that reads it as one sequence scores differently.
    one = torch.zeros_like(batch["segment_ids"])
    whole = dict(kwargs, attention_mask=block_mask(one, one - 1, batch["position_ids"]))
    assert _max_difference(_per_sequence(model, batch, whole), got) > 1e-3


def test_every_flex_forward_of_a_packed_row_is_kept_off_the_decoding_kernel(monkeypatch):
    """Each layer's flex attention call gets FLEX_KERNEL_OPTIONS (head.forward_inputs) on a row under 128
    tokens without gradients, where PyTorch would take its decoding kernel, wrong on packed rows
    (test_packed_flex_gpu.py): shared row, padding-free row, padded rows, and both models of a
    distillation forward; other implementations get nothing. Flex runs here through its own eager
    forward: inductor's CPU build of these short rows fails to compile."""
    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention.flex_attention import flex_attention

    from fusedalign.distill_head import token_divergence

    seen = []

    def spy(*args, training=False, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return flex_attention(*args, **kwargs)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", spy)
    model = load_model("builtin:tiny-qwen2", attn_implementation="flex_attention")
    layers = model.config.num_hidden_layers
    for share in (True, False):
        batch = preference_batch(ROWS["uneven"][:3], share_prompt=share)
        assert batch["input_ids"].shape[1] < 128
        kwargs = attention_inputs(model, batch)
        assert forward_inputs(model, kwargs)["kernel_options"] == FLEX_KERNEL_OPTIONS
        seen.clear()
        _per_sequence(model, batch, kwargs)
        assert seen == [FLEX_KERNEL_OPTIONS] * layers
    ids = batch["input_ids"][:, :40].repeat(2, 1)
    padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids).index_fill_(1, torch.arange(30, 40), 0)}
    seen.clear()
    with torch.no_grad():
        token_logprobs(model, padded, labels=ids)
        token_divergence(model, model, padded, ids, fused=False)
    assert seen == [FLEX_KERNEL_OPTIONS] * (3 * layers)
    assert flex_kernel_options(model) == {"kernel_options": FLEX_KERNEL_OPTIONS}
    sdpa = _model("qwen2", "sdpa")
    assert flex_kernel_options(sdpa) == {}
    assert "kernel_options" not in forward_inputs(sdpa, attention_inputs(sdpa, preference_batch(ROWS["uneven"],
                                                                                               share_prompt=True)))


# ------------------------------------------------------------------ refusals


def _with_config(name: str, attn: str, **config):
    model = copy.deepcopy(_model(name, attn))
    for key, value in config.items():
        setattr(model.config, key, value)
    return model


def test_flash_attention_takes_padding_free_rows_and_refuses_a_shared_prompt():
    model = _with_config("qwen2", "sdpa", _attn_implementation="flash_attention_2")
    assert set(attention_inputs(model, preference_batch(ROWS["uneven"]))) == {"input_ids", "position_ids"}
    with pytest.raises(PackedAttentionError, match="share_prompt: attention implementation 'flash_attention_2'.*"
                                                   "where position_ids return to 0.*flex_attention"):
        attention_inputs(model, preference_batch(ROWS["uneven"], share_prompt=True))


def test_softcapped_attention_on_sdpa_is_refused():
    model = _with_config("gemma2", "eager", _attn_implementation="sdpa")
    with pytest.raises(PackedAttentionError, match="Gemma2ForCausalLM soft-caps its attention logits.*eager or flex"):
        attention_inputs(model, preference_batch(ROWS["uneven"]))


def test_an_implementation_without_a_mask_path_is_refused():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("unmasked_sdpa_test", sdpa_attention_forward)
    model = _with_config("llama", "sdpa", _attn_implementation="unmasked_sdpa_test")
    for share in (False, True):
        with pytest.raises(PackedAttentionError, match="'unmasked_sdpa_test' has no mask builder"):
            attention_inputs(model, preference_batch(ROWS["uneven"], share_prompt=share))


def test_layers_that_carry_state_across_the_row_are_refused():
    model = _with_config("qwen2", "sdpa", layer_types=["linear_attention", "full_attention"])
    with pytest.raises(PackedAttentionError, match="layers of type 'linear_attention'.*padded batches"):
        attention_inputs(model, preference_batch(ROWS["uneven"]))


def test_mixed_layer_types_without_a_mask_per_type_are_refused_once_the_window_matters():
    """LlamaModel's forward takes one mask for every layer (no dict per layer type)."""
    model = _with_config("llama", "sdpa", layer_types=["sliding_attention", "full_attention"], sliding_window=12)
    short = [r for r in ROWS["uneven"]
             if len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) <= 12]
    assert short
    attention_inputs(model, preference_batch(short, share_prompt=True))  # no position reaches the window
    attention_inputs(model, preference_batch(ROWS["long"]))  # padding-free: transformers' builders keep windows
    with pytest.raises(PackedAttentionError, match="LlamaForCausalLM mixes layer types.*Drop --share_prompt"):
        attention_inputs(model, preference_batch(ROWS["long"], share_prompt=True))


# ------------------------------------------------------------------ CUDA (the H200): flex gradients, transformers 5.17


CUDA_CASES = [("qwen2", "flex_attention", "sdpa"), ("llama", "flex_attention", "sdpa"), ("qwen2", "sdpa", "sdpa"),
              ("gemma2", "flex_attention", "eager"), ("gemma2", "eager", "eager")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (flex attention's backward)")
@pytest.mark.parametrize("share", [False, True], ids=["padding_free", "shared_prompt"])
@pytest.mark.parametrize("name, attn, padded_attn", CUDA_CASES)
def test_packed_rows_on_cuda_equal_padded_unshared(name, attn, padded_attn, share):
    """Log-probs, the DPO loss and every gradient (fp32) through each implementation on CUDA,
    long rows included (Gemma 2's window). Kernels differ from the padded reference's, hence 1e-4."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = load_model(f"builtin:tiny-{name}", attn_implementation=attn).cuda()
    padded = load_model(f"builtin:tiny-{name}", attn_implementation=padded_attn).cuda()
    padded.load_state_dict(model.state_dict())
    for data in ("uneven", "long"):
        rows = ROWS[data]
        want_seq, want_loss = _padded(padded, rows, True)
        got = _packed(model, rows, share, True)
        # The two models hold equal weights: compare the padded model's gradients with the packed one's.
        want_grads = torch.autograd.grad(want_loss, list(padded.parameters()))
        got_grads = torch.autograd.grad(got[1], list(model.parameters()))
        for (wl, wp), (gl, gp) in zip(want_seq, got[0]):
            assert torch.equal(wl.cpu(), gl.cpu())
            torch.testing.assert_close(gp, wp, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], want_loss, rtol=1e-4, atol=1e-4)
        for w, g in zip(want_grads, got_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
