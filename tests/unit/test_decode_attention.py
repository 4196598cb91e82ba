"""StaticDecode's attention: a decoding step's grouped query heads against their shared key/value
heads (`fusedalign.generation.decode_attention`), equal to attention against copies of them."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fusedalign.generation import HFGenerate, StaticDecode
from fusedalign.generation.decode_attention import (
    GROUPED,
    decoding_attention,
    decoding_implementation,
    grouped_sdpa_forward,
)
from fusedalign.models import load_model, load_tokenizer


class _Module(torch.nn.Module):  # what the attention functions read off a layer
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


def _by_hand(query, key, value, visible, scale):
    """[B, q, h, d]: softmax(q·k·scale over visible keys)·v, each query head against its group's key head."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, -math.inf)
    return (scores.softmax(-1) @ value).transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (14, 2), (4, 4), (8, 1)])
def test_one_query_position_is_attention_against_the_groups_key_heads(heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    B, L, d = 3, 11, 8
    query = torch.randn(B, heads, 1, d, generator=g, dtype=torch.float64)
    key, value = (torch.randn(B, kv_heads, L, d, generator=g, dtype=torch.float64) for _ in range(2))
    visible = torch.ones(B, 1, 1, L, dtype=torch.bool)
    visible[0, ..., :4] = False  # left padding of several lengths, and slots not yet written
    visible[1, ..., :1] = False
    visible[..., 9:] = False
    module = _Module(heads // kv_heads)
    got, _ = grouped_sdpa_forward(module, query, key, value, visible, scaling=0.3)
    assert got.shape == (B, 1, heads, d) and got.is_contiguous()
    torch.testing.assert_close(got, _by_hand(query, key, value, visible, 0.3), rtol=1e-12, atol=1e-12)
    want, _ = sdpa_attention_forward(module, query, key, value, visible, scaling=0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_several_query_positions_are_transformers_sdpa():
    g = torch.Generator().manual_seed(1)
    query = torch.randn(2, 6, 5, 8, generator=g)
    key, value = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(2))
    visible = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    module = _Module(3)
    got, _ = grouped_sdpa_forward(module, query, key, value, visible, scaling=0.5)
    want, _ = sdpa_attention_forward(module, query, key, value, visible, scaling=0.5)
    assert torch.equal(got, want)


def test_the_switch_covers_sdpa_and_flex_and_leaves_eager_and_soft_capping():
    qwen = load_model("builtin:tiny-qwen2", attn_implementation="sdpa")
    assert decoding_implementation(qwen) == GROUPED
    qwen.config._attn_implementation = "flex_attention"
    assert decoding_implementation(qwen) == GROUPED
    assert decoding_implementation(load_model("builtin:tiny-qwen2", attn_implementation="eager")) == "eager"
    gemma = load_model("builtin:tiny-gemma2", attn_implementation="flex_attention")
    assert gemma.config.attn_logit_softcapping is not None  # sdpa has no soft-capping
    assert decoding_implementation(gemma) == "flex_attention"


def test_the_models_attention_comes_back_after_a_generation_and_after_an_error():
    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa")
    with decoding_attention(model):
        assert model.config._attn_implementation == GROUPED
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"):
        with decoding_attention(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_the_loop_decodes_as_generate_on_sdpa_and_flex_models(attn):
    """Greedy tokens of the loop over a model whose attention is `attn` equal generate's over the
    same weights on transformers' sdpa; a flex-attention model (packed training rows) is decoded
    by the loop now, not handed to generate, and keeps its attention."""
    tok = load_tokenizer("builtin:tiny-qwen2")
    model = load_model("builtin:tiny-qwen2", attn_implementation=attn).eval()
    reference = load_model("builtin:tiny-qwen2", attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in (3, 7, 5, 1, 9)]
    keys = [(i, 0) for i in range(len(prompts))]
    kw = dict(max_new_tokens=14, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False)
    decode = StaticDecode(**kw)
    got = decode.generate(model, prompts, keys)
    assert decode.last_call["path"] == "static"
    assert model.config._attn_implementation == attn
    want = HFGenerate(**kw).generate(reference, prompts, keys)
    assert got.completion_ids == want.completion_ids
    assert any(len(c) > 3 for c in got.completion_ids)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
def test_reading_only_the_written_slots_changes_nothing(heads, kv_heads):
    """A one-token step whose mask covers the first n slots reads those n slots; the output is
    that of the whole cache with the slots after masked, for grouped and plain heads."""
    g = torch.Generator().manual_seed(7)
    B, L, d, n = 2, 12, 8, 7
    query = torch.randn(B, heads, 1, d, generator=g, dtype=torch.float64)
    key, value = (torch.randn(B, kv_heads, L, d, generator=g, dtype=torch.float64) for _ in range(2))
    visible = torch.zeros(B, 1, 1, L, dtype=torch.bool)
    visible[..., 2:n] = True
    module = _Module(heads // kv_heads)
    whole, _ = grouped_sdpa_forward(module, query, key, value, visible, scaling=0.4)
    part, _ = grouped_sdpa_forward(module, query, key, value, visible[..., :n], scaling=0.4)
    several, _ = grouped_sdpa_forward(module, query.expand(B, heads, 3, d), key, value,
                                      visible.expand(B, 1, 3, L), scaling=0.4)
    torch.testing.assert_close(part, whole, rtol=1e-12, atol=1e-12)
    assert several.shape == (B, 3, heads, d)  # several query positions: the whole cache, as transformers'
    # It reads only those slots: what lies after them does not reach the output, even unmasked.
    key[..., n:, :] = float("nan")
    value[..., n:, :] = float("nan")
    part, _ = grouped_sdpa_forward(module, query, key, value, visible[..., :n], scaling=0.4)
    torch.testing.assert_close(part, whole, rtol=1e-12, atol=1e-12)


def test_a_graphs_window_rounds_up_to_its_step_and_stops_at_the_cache():
    decode = StaticDecode(max_new_tokens=4, eos_token_id=0, pad_token_id=0, window_slots=64)
    assert [decode._window(w, 300) for w in (1, 64, 65, 250, 257)] == [64, 64, 128, 256, 300]
    assert StaticDecode(max_new_tokens=4, eos_token_id=0, pad_token_id=0, window_slots=0)._window(5, 300) == 300


@pytest.mark.cuda_path
def test_a_bf16_decoding_step_on_the_05b_heads_is_no_worse_grouped():
    """One decoding step of a model with Qwen2.5-0.5B's attention shape (14 query heads, 2
    key/value heads of 64) in bfloat16, over a static cache with left padding: the grouped
    attention's logits err against the float32 truth no more than transformers' own sdpa's
    (on CUDA, cuDNN's kernels for 7 query rows against those for 1)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, StaticCache

    from fusedalign.generation.decode_state import cache_keyword, dtype_stable

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=896, num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=1024, vocab_size=4096, attn_implementation="sdpa")
    truth = AutoModelForCausalLM.from_config(config).to(device).eval()
    bf16 = AutoModelForCausalLM.from_config(config).to(device, torch.bfloat16).eval()
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in truth.state_dict().items()})
    B, P = (64, 96) if device == "cuda" else (4, 12)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, config.vocab_size, (B, P), generator=g).to(device)
    mask = torch.ones_like(ids)
    for row in range(B):
        mask[row, : row % (P // 2)] = 0  # left padding of every amount
    nxt = torch.randint(1, config.vocab_size, (B, 1), generator=g).to(device)

    def step(model, grouped: bool) -> torch.Tensor:
        cache = dtype_stable(StaticCache(config=model.config, max_cache_len=P + 4))
        kw = {cache_keyword(model): cache}
        with torch.no_grad(), (decoding_attention(model) if grouped else contextlib.nullcontext()):
            model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                  use_cache=True, **kw)
            visible = torch.zeros(B, 1, 1, P + 4, dtype=torch.bool, device=device)
            visible[:, 0, 0, :P] = mask.bool()
            visible[:, 0, 0, P] = True
            out = model(input_ids=nxt, attention_mask=visible[..., : P + 1] if grouped else visible,
                        position_ids=mask.sum(-1, keepdim=True), use_cache=True, **kw)
        return out.logits[:, -1].float()

    want = step(truth, grouped=False)
    torch.testing.assert_close(step(truth, grouped=True), want, rtol=1e-4, atol=1e-4)
    grouped_err = (step(bf16, grouped=True) - want).abs().max().item()
    plain_err = (step(bf16, grouped=False) - want).abs().max().item()
    assert grouped_err <= 2 * plain_err + 1e-3, (grouped_err, plain_err)
