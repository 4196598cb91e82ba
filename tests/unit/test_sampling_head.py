"""The sampling head: the next token drawn inside the head's forward, slice by slice of the
vocabulary, is the logits path's token (greedy, penalised, keyed, with LoRA on the head, soft-capped
logits, compaction), and unkeyed draws follow the processed softmax, eagerly, from the compiled step
and (CUDA) from graph replays, with fresh noise at every step."""

from __future__ import annotations

import math

import pytest
import torch

from fusedalign.architectures import post_processing_of
from fusedalign.generation import KeyedSampler, StaticDecode
from fusedalign.generation import sampling_head as sampling
from fusedalign.generation.decode_state import filters_off, process_logits
from fusedalign.models import load_model, load_tokenizer

PROMPT_LENGTHS = (3, 7, 5, 1, 9, 4)
SLICING = (sampling.CHUNK_ELEMENTS, sampling.MIN_SLICE)  # the library's, before _small_slices


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


def _context_free_head(model, live: int):
    """Replaces the model's head by one whose logits are the same vector b at every position: b's first
    `live` tokens random, the rest -30 (never drawn). Returns b."""
    vocab, device = model.config.vocab_size, model.device
    b = torch.full((vocab,), -30.0, device=device)
    b[:live] = torch.randn(live, generator=torch.Generator().manual_seed(0)).to(device) * 2
    head = torch.nn.Linear(model.config.hidden_size, vocab, bias=True, device=device)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(b)
    model.lm_head = head
    return b


def _tv_noise(want: torch.Tensor, n: int) -> float:
    """The expected total variation between `want` and the histogram of n independent draws from it."""
    return float(0.5 * (2 * want * (1 - want) / (math.pi * n)).sqrt().sum())


def _assert_fresh_draws_of_the_processed_softmax(tokens, b, prompt, first: int, **processing):
    """tokens [rows, steps] drawn from softmax(process_logits(b, seen)) with the row's seen tokens (its
    prompt and its draws so far: the penalty makes each draw's distribution depend on the row's past).
    Checked on the draws from step `first` on: their histogram is the mean of each draw's distribution
    given its row's past (within 3x the sampling noise); at the first of them the rows draw apart (noise
    per row); and a row draws its previous token again as often as fresh draws would (the expected
    count within 5 standard deviations; the same noise at every step makes it several times more)."""
    rows, steps = tokens.shape
    seen = torch.zeros(rows, b.shape[0], dtype=torch.bool, device=b.device)
    seen[:, prompt] = True
    want = torch.zeros(b.shape[0], dtype=torch.float64, device=b.device)
    repeats = expected = variance = 0.0
    at_first = None
    for t in range(steps):
        p = process_logits(b.expand(rows, -1), seen, **processing).double().softmax(-1)  # [rows, V]
        if t >= first:
            want += p.sum(0)
            if t == first:
                at_first = p.mean(0)
            else:
                again = p.gather(-1, tokens[:, t - 1:t])[:, 0]  # each row's chance of its previous token
                expected, variance = expected + float(again.sum()), variance + float((again * (1 - again)).sum())
                repeats += float((tokens[:, t] == tokens[:, t - 1]).sum())
        seen[torch.arange(rows, device=b.device), tokens[:, t]] = True
    drawn = tokens[:, first:]
    want /= drawn.numel()
    got = torch.bincount(drawn.flatten(), minlength=b.shape[0]).double() / drawn.numel()
    assert 0.5 * float((got - want).abs().sum()) < 3 * _tv_noise(want, drawn.numel()), (got, want)
    assert got[want < 1e-12].sum() == 0
    got_first = torch.bincount(tokens[:, first], minlength=b.shape[0]).double() / rows
    assert 0.5 * float((got_first - at_first).abs().sum()) < 3 * _tv_noise(at_first, rows)
    assert abs(repeats - expected) < 5 * math.sqrt(variance), (repeats, expected, math.sqrt(variance))


@pytest.fixture
def fresh_dynamo():
    """No compiled code or counts from another test (dynamo keeps them per process)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def test_the_compiled_step_draws_fresh_samples_of_the_processed_softmax_in_the_head(monkeypatch, fresh_dynamo):
    """Unkeyed sampling (temperature and repetition penalty: the head draws) from the inductor-compiled
    step, the vocabulary in 4 slices: the draws follow the processed softmax given each row's past, and
    inductor's random numbers are fresh at every step and for every row (a context-free head)."""
    rows, steps = 2048, 12
    monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", 128 * rows)  # 4 slices of 128 tokens
    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa").eval()
    tok = load_tokenizer("builtin:tiny-qwen2")
    b = _context_free_head(model, live=48)
    prompt = _prompts()[1]
    flags = dict(temperature=0.8, repetition_penalty=1.5)
    decode = StaticDecode(max_new_tokens=steps, eos_token_id=model.config.vocab_size - 1,
                          pad_token_id=tok.pad_token_id, do_sample=True, fused_sampling=True, compile_step=True,
                          **flags)
    torch.manual_seed(0)
    out = decode.generate(model, [prompt] * rows, _keys(rows))
    assert decode.last_call["compiled"] is True and decode.last_call["fused_sampling"] is True, decode.last_call
    assert decode.last_call["steps"] == steps and not fresh_dynamo["graph_break"]
    _assert_fresh_draws_of_the_processed_softmax(torch.tensor(out.completion_ids), b, prompt, first=1, **flags)


def test_filters_take_the_logits_path():
    model = load_model("builtin:tiny-qwen2")
    assert "top-k" in sampling.usable(model, dict(top_k=20, top_p=1.0, min_p=None), None)
    assert "keyed" in sampling.usable(model, dict(top_k=0, top_p=1.0, min_p=None), KeyedSampler(0, top_p=0.9))
    assert sampling.usable(model, dict(top_k=0, top_p=1.0, min_p=None), None) is None
    # Flags that remove no token are no filtering, as for the logits path (`keyed.filter_logits`)
    # and the draw kernel (`decode_state.filters_off`): the vocabulary's size or more, min-p 0.
    vocab = model.config.vocab_size
    for none in (dict(top_k=vocab, top_p=1.0, min_p=None), dict(top_k=vocab + 5, top_p=1.0, min_p=0.0),
                 dict(top_k=-1, top_p=1.0, min_p=None)):
        assert sampling.usable(model, none, None) is None, none
        assert sampling.usable(model, dict(top_k=0, top_p=1.0, min_p=None), KeyedSampler(0, **none)) is None, none
        assert filters_off(dict(none, repetition_penalty=1.0), vocab), none
    assert "top-k" in sampling.usable(model, dict(top_k=vocab - 1, top_p=1.0, min_p=None), None)
    assert "keyed" in sampling.usable(model, dict(top_k=0, top_p=1.0, min_p=None), KeyedSampler(0, top_k=vocab - 1))
    tok = load_tokenizer("builtin:tiny-qwen2")
    d = StaticDecode(max_new_tokens=4, eos_token_id=tok.eos_token_id, pad_token_id=0, top_k=20, fused_sampling=True)
    d.generate(model.eval(), _prompts()[:2], _keys(2))
    assert d.last_call["fused_sampling"] is False and "top-k" in d.last_call["why_not_fused"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_fused_sampling_under_cuda_graphs_draws_the_logits_paths_tokens(penalty):
    """Greedy, float32, 24 rows: the graphed loop drawing in the head gives the eager logits path's
    tokens (the sampled draws: the next test)."""
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_sampling_under_cuda_graphs_draws_fresh_samples_of_the_processed_softmax(monkeypatch, compiled):
    """Unkeyed sampling at batch 1,024 (temperature and repetition penalty: the head draws) from graph
    replays of the decoding step: the draws follow the processed softmax of a context-free head given each
    row's past, and the replays draw fresh noise at every step and for every row. Compiled: inductor's
    random numbers, replayed in the graph, too."""
    from tests.unit.test_static_decode import _cuda_model

    monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", SLICING[0])  # the library's slices of the 152k vocabulary
    monkeypatch.setattr(sampling, "MIN_SLICE", SLICING[1])
    tok = load_tokenizer("builtin:tiny-qwen2")
    model = _cuda_model()
    b = _context_free_head(model, live=64)
    prompt = _prompts()[1]
    flags = dict(temperature=0.8, repetition_penalty=1.3)
    decode = StaticDecode(max_new_tokens=24, eos_token_id=model.config.vocab_size - 1,
                          pad_token_id=tok.pad_token_id, do_sample=True, fused_sampling=True, compile_step=compiled,
                          **flags)
    torch.manual_seed(0)
    out = decode.generate(model, [prompt] * 1024, _keys(1024))
    assert decode.last_call["graph"] is True and decode.last_call["fused_sampling"] is True, decode.last_call
    assert decode.last_call["steps"] == 24 and decode.last_call["compiled"] is compiled
    tokens = torch.tensor(out.completion_ids, device="cuda")
    _assert_fresh_draws_of_the_processed_softmax(tokens, b, prompt, first=2, **flags)  # from the replayed steps
