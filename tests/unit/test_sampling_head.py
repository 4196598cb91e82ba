"""The sampling head: the next token drawn inside the head's forward, slice by slice of the
vocabulary, is the logits path's token (greedy, penalised, keyed, with LoRA on the head, soft-capped
logits, compaction), and unkeyed draws follow the processed softmax."""

from __future__ import annotations

import pytest
import torch

from fusedalign.architectures import post_processing_of
from fusedalign.generation import KeyedSampler, StaticDecode
from fusedalign.generation import sampling_head as sampling
from fusedalign.generation.decode_state import process_logits
from fusedalign.models import load_model, load_tokenizer

PROMPT_LENGTHS = (3, 7, 5, 1, 9, 4)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 400, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _keys(n: int) -> list[tuple[int, int]]:
    return [(i, i % 2) for i in range(n)]


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch):
    monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", 600)  # several slices of the tiny vocabulary
    monkeypatch.setattr(sampling, "MIN_SLICE", 16)


@pytest.mark.parametrize("name,attn", [("builtin:tiny-qwen2", "sdpa"), ("builtin:tiny-qwen2", "eager"),
                                       ("builtin:tiny-llama", "sdpa"), ("builtin:tiny-llama", "eager"),
                                       ("builtin:tiny-gemma2", "eager")])  # (transformers has no sdpa for Gemma 2)
@pytest.mark.parametrize("flags", [dict(do_sample=False), dict(do_sample=False, repetition_penalty=1.4),
                                   dict(keyed=dict(temperature=0.7)),
                                   dict(repetition_penalty=1.3, keyed=dict(temperature=1.3))],
                         ids=["greedy", "penalty", "keyed", "keyed_penalty"])
def test_fused_sampling_draws_the_tokens_of_the_logits_path(name, attn, flags):
    """The head's tokens (and keyed log-probs) are the logits path's. Gemma 2 has sliding-window layers:
    StaticDecode declares its fallback to transformers' generate, and fused_sampling=True changes
    nothing there (generate's tokens)."""
    from fusedalign.generation import HFGenerate

    model, tok = load_model(name, attn_implementation=attn).eval(), load_tokenizer(name)
    assert model.config._attn_implementation == attn
    flags = dict(flags)
    keyed = flags.pop("keyed", None)
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    kw = dict(max_new_tokens=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **flags)

    def decode(fused: bool):
        sampler = KeyedSampler(5, **keyed) if keyed else None
        d = StaticDecode(sampler=sampler, fused_sampling=fused, **kw)
        return d, d.generate(model, prompts, keys, step=1)

    fused, got = decode(True)
    plain, want = decode(False)
    if "gemma2" in name:
        assert fused.last_call == plain.last_call == {"path": "generate", "why": "sliding-window layers"}
        generated = HFGenerate(sampler=KeyedSampler(5, **keyed) if keyed else None, **kw).generate(
            model, prompts, keys, step=1)
        assert got.completion_ids == generated.completion_ids and got.truncated == generated.truncated
    else:
        assert fused.last_call["fused_sampling"] is True and plain.last_call["fused_sampling"] is False
    assert got.completion_ids == want.completion_ids and got.truncated == want.truncated
    assert any(len(c) > 3 for c in got.completion_ids)
    if keyed:
        for a, b in zip(got.logprobs, want.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_fused_sampling_with_lora_on_the_head_and_compaction():
    from peft import LoraConfig, get_peft_model

    tok = load_tokenizer("builtin:tiny-qwen2")
    torch.manual_seed(0)  # lora_A's init draws from the global generator, whose seed differs from run to run
    model = get_peft_model(load_model("builtin:tiny-qwen2"), LoraConfig(r=4, lora_alpha=8,
                                                                        target_modules=["lm_head", "q_proj"]))
    with torch.no_grad():  # an adapter that changes the draws
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    model.eval()
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    kw = dict(max_new_tokens=24, pad_token_id=tok.pad_token_id, do_sample=False, check_every=2)
    free = StaticDecode(eos_token_id=tok.eos_token_id, **kw).generate(model, prompts, keys).completion_ids
    eos = sorted({free[0][1], free[1][3], free[2][2]})
    fused = StaticDecode(eos_token_id=eos, fused_sampling=True, **kw)
    got = fused.generate(model, prompts, keys)
    want = StaticDecode(eos_token_id=eos, compact_below=0, **kw).generate(model, prompts, keys)
    assert fused.last_call["fused_sampling"] and len(fused.last_call["batch_sizes"]) >= 2, fused.last_call
    assert got.completion_ids == want.completion_ids
    with model.disable_adapter():  # the adapter is read: without it the draws differ
        assert StaticDecode(eos_token_id=eos, **kw).generate(model, prompts, keys).completion_ids != got.completion_ids


def _head_inputs(vocab=300, hidden=16, rows=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 1, hidden, generator=g), torch.randn(vocab, hidden, generator=g), \
        torch.randn(vocab, generator=g)


def test_soft_capped_and_scaled_logits_are_post_processed_as_the_model_does():
    """A keyed draw (token and log-prob) from the slices equals the sampler's from the whole
    post-processed logits: the soft-cap and the scale are applied, in the head's dtype."""
    from fusedalign.architectures import PostProcessing

    x, w, b = _head_inputs()
    sampler = KeyedSampler(2, temperature=0.9)
    sampler.bind(_keys(4), prompt_length=3, step=0)
    for post in (PostProcessing(softcap=2.0), PostProcessing(logit_scale=0.25)):
        head = sampling.SamplingHead(post, repetition_penalty=1.0, temperature=0.9, do_sample=False, seen=None,
                                     sampler=sampler, position=3)
        z = (x[:, -1] @ w.T + b) * post.logit_scale
        if post.softcap is not None:
            z = torch.tanh(z / post.softcap) * post.softcap
        tokens, logps = sampler.draw(z, 3)
        drawn = head.compute(x, w, b, None)
        assert torch.equal(drawn[:, 0, 0].long(), tokens)
        torch.testing.assert_close(drawn[:, 0, 1], logps.float(), rtol=0, atol=1e-5)


def test_unkeyed_draws_follow_the_processed_softmax():
    x, w, b = _head_inputs(vocab=40, rows=1)
    rows = 100_000
    x = x.expand(rows, 1, -1).contiguous()
    seen = torch.zeros(rows, 40, dtype=torch.bool)
    seen[:, :5] = True
    head = sampling.SamplingHead(post_processing_of(load_model("builtin:tiny-qwen2")), repetition_penalty=1.5,
                                 temperature=0.8, do_sample=True, seen=seen)
    torch.manual_seed(0)
    tokens = head.compute(x, w * 0.3, b, None)[:, 0, 0].long()
    want = process_logits((x[:1, -1] @ (w * 0.3).T + b).float(), seen[:1], repetition_penalty=1.5,
                          temperature=0.8)[0].double().softmax(-1)
    got = torch.bincount(tokens, minlength=40).double() / rows
    assert 0.5 * (got - want).abs().sum() < 0.01, (got, want)


def test_filters_take_the_logits_path():
    model = load_model("builtin:tiny-qwen2")
    assert "top-k" in sampling.usable(model, dict(top_k=20, top_p=1.0, min_p=None), None)
    assert "keyed" in sampling.usable(model, dict(top_k=0, top_p=1.0, min_p=None), KeyedSampler(0, top_p=0.9))
    assert sampling.usable(model, dict(top_k=0, top_p=1.0, min_p=None), None) is None
    tok = load_tokenizer("builtin:tiny-qwen2")
    d = StaticDecode(max_new_tokens=4, eos_token_id=tok.eos_token_id, pad_token_id=0, top_k=20, fused_sampling=True)
    d.generate(model.eval(), _prompts()[:2], _keys(2))
    assert d.last_call["fused_sampling"] is False and "top-k" in d.last_call["why_not_fused"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_fused_sampling_under_cuda_graphs_draws_the_logits_paths_tokens(penalty):
    """Greedy, float32: the graphed loop drawing in the head equals the eager logits path; and its
    sampled draws at batch 1,024 follow the processed softmax of a context-free head."""
    from tests.unit.test_static_decode import _cuda_model

    tok = load_tokenizer("builtin:tiny-qwen2")
    model = _cuda_model()
    prompts, keys = _prompts() * 4, _keys(4 * len(PROMPT_LENGTHS))
    kw = dict(max_new_tokens=40, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False,
              repetition_penalty=penalty)
    fused = StaticDecode(**kw, fused_sampling=True)
    got = fused.generate(model, prompts, keys).completion_ids
    assert fused.last_call["graph"] and fused.last_call["fused_sampling"], fused.last_call
    assert got == StaticDecode(**kw, cuda_graphs=False).generate(model, prompts, keys).completion_ids
