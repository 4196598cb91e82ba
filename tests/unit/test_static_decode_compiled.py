"""StaticDecode's compiled step (`compile_step=True`, inductor): the eager loop's greedy tokens, one
compilation for every batch size, window and later call, and fresh draws of the processed softmax.

The compiled step also goes through the graph bookkeeping: on the CPU a stand-in for CUDA
graphs replays it with the window it was captured with, as a graph would (the CUDA twins are
in test_static_decode.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch._dynamo.utils import counters

from fusedalign.generation import StaticDecode
from fusedalign.generation.static import process_logits
from fusedalign.models import load_model, load_tokenizer
from tests.stand_in_graphs import stand_in_graphs

PROMPT_LENGTHS = (3, 7, 5, 1, 9)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 400, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _keys(n: int) -> list[tuple[int, int]]:
    return [(i, 0) for i in range(n)]


@pytest.fixture
def fresh_dynamo():
    """No compiled code or counts from another test (dynamo keeps them per process)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("attn,penalty", [("sdpa", 1.4), ("eager", 1.0)])
def test_a_compiled_step_decodes_as_the_eager_loop(monkeypatch, capsys, fresh_dynamo, attn, penalty):
    """Greedy tokens equal the uncompiled loop's, through graph windows of 4 slots and a
    compaction; dynamo compiles the step once, without graph breaks, and later calls (new
    cache, new state, other prompts, weights changed in place) run the same compiled code and
    see the new weights."""
    model = load_model("builtin:tiny-qwen2", attn_implementation=attn).eval()
    tok = load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    kw = dict(max_new_tokens=14, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False,
              repetition_penalty=penalty)
    # An end-of-sequence token that one row draws early, so that the batch is compacted.
    first = StaticDecode(**kw, cuda_graphs=False).generate(model, prompts, keys).completion_ids
    kw["eos_token_id"] = first[2][1]
    loop = dict(window_slots=4, compact_below=0.9, check_every=2)
    want = StaticDecode(**kw, cuda_graphs=False, **loop).generate(model, prompts, keys)

    captured = stand_in_graphs(monkeypatch, rules=False)  # a graph break would show a sync
    decode = StaticDecode(**kw, compile_step=True, **loop)
    got = decode.generate(model, prompts, keys)
    assert decode.last_call["compiled"] is True and decode.last_call["graphs"] >= 3
    assert len(decode.last_call["batch_sizes"]) >= 2, decode.last_call  # compacted
    assert got.completion_ids == want.completion_ids and got.truncated == want.truncated
    assert len(set(captured)) >= 3  # several windows, one compilation
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]

    others = [p[::-1] + [5] for p in prompts[1:]]
    again = decode.generate(model, others, keys[1:])
    assert again.completion_ids == StaticDecode(**kw, cuda_graphs=False, **loop).generate(
        model, others, keys[1:]).completion_ids
    # What an optimizer step does (new values in the same storage): the compiled code sees them.
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = decode.generate(model, prompts, keys)
    assert after.completion_ids == StaticDecode(**kw, cuda_graphs=False, **loop).generate(
        model, prompts, keys).completion_ids
    assert after.completion_ids != got.completion_ids
    assert counters["stats"]["unique_graphs"] == 1
    # One line says why the first generation takes longer, once.
    assert capsys.readouterr().err.count("[fusedalign] compiling the decoding step") == 1


def test_a_keyed_sampler_keeps_the_step_uncompiled():
    """A keyed draw reads host-side state every token: compiling it would break the graph and
    recompile per position, so the step stays eager."""
    from fusedalign.generation import KeyedSampler

    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa").eval()
    tok = load_tokenizer("builtin:tiny-qwen2")
    decode = StaticDecode(max_new_tokens=4, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          sampler=KeyedSampler(3), compile_step=True)
    decode.generate(model, _prompts(), _keys(len(PROMPT_LENGTHS)))
    assert decode.last_call["compiled"] is False


def test_compiled_draws_are_fresh_samples_of_the_processed_softmax(fresh_dynamo):
    """A head whose logits are the same vector b at every position: the tokens the compiled step
    draws (inductor's random numbers, not torch.rand's) follow the processed softmax of b, and
    every step draws fresh noise."""
    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa").eval()
    tok = load_tokenizer("builtin:tiny-qwen2")
    vocab = model.config.vocab_size
    b = torch.full((vocab,), -30.0)
    b[:48] = torch.randn(48, generator=torch.Generator().manual_seed(0)) * 2
    head = torch.nn.Linear(model.config.hidden_size, vocab, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(b)
    model.lm_head = head
    flags = dict(temperature=0.8, top_k=40, top_p=0.95)
    decode = StaticDecode(max_new_tokens=12, eos_token_id=vocab - 1, pad_token_id=tok.pad_token_id,
                          compile_step=True, **flags)
    torch.manual_seed(0)
    out = decode.generate(model, [_prompts()[1]] * 2048, _keys(2048))
    assert decode.last_call["compiled"] is True and decode.last_call["steps"] == 12
    tokens = torch.tensor(out.completion_ids)[:, 1:]  # the compiled steps' draws
    want = process_logits(b[None], None, **flags)[0].double().softmax(-1)
    got = torch.bincount(tokens.flatten(), minlength=vocab).double() / tokens.numel()
    assert 0.5 * (got - want).abs().sum() < 0.02
    assert got[want == 0].sum() == 0
    # Fresh noise each step: a row repeats one token all along as often as independent draws do.
    repeated = (tokens == tokens[:, :1]).all(1).double().mean()
    assert abs(repeated - (want ** tokens.shape[1]).sum()) < 0.02, (repeated, (want ** tokens.shape[1]).sum())
    # and each row's draws differ from the other rows' (noise per row, not per step)
    assert (tokens[:, 0] != tokens[0, 0]).any()


def test_a_compiled_step_with_the_sampling_head_decodes_as_the_eager_loop(fresh_dynamo):
    """The sampling head is installed around the call, not inside the step, so dynamo compiles
    the step with the draw in it as one graph, without a break; the greedy tokens stay those of
    the uncompiled loop."""
    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa").eval()
    tok = load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    kw = dict(max_new_tokens=10, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False,
              fused_sampling=True)
    want = StaticDecode(**kw, cuda_graphs=False).generate(model, prompts, keys)
    decode = StaticDecode(**kw, compile_step=True)
    got = decode.generate(model, prompts, keys)
    assert decode.last_call["compiled"] is True and decode.last_call["fused_sampling"] is True
    assert got.completion_ids == want.completion_ids
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])


def test_a_compiled_step_with_the_sampling_head_follows_compaction_and_the_penalty(monkeypatch, fresh_dynamo):
    """With the head installed around the call, its `seen` (the repetition penalty's tokens) is
    rebound at each compaction: the compiled step reads the live rows' tokens, and the greedy
    tokens stay those of the uncompiled loop without compaction."""
    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa").eval()
    tok = load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    kw = dict(max_new_tokens=14, pad_token_id=tok.pad_token_id, do_sample=False, repetition_penalty=1.5)
    first = StaticDecode(eos_token_id=tok.eos_token_id, cuda_graphs=False, **kw).generate(
        model, prompts, keys).completion_ids
    eos = first[2][1]  # a token one row draws early: the batch is compacted
    want = StaticDecode(eos_token_id=eos, cuda_graphs=False, compact_below=0, **kw).generate(model, prompts, keys)
    stand_in_graphs(monkeypatch, rules=False)
    decode = StaticDecode(eos_token_id=eos, fused_sampling=True, compile_step=True, window_slots=4,
                          compact_below=0.9, check_every=2, **kw)
    got = decode.generate(model, prompts, keys)
    assert decode.last_call["fused_sampling"] is True and decode.last_call["compiled"] is True
    assert len(decode.last_call["batch_sizes"]) >= 2, decode.last_call  # compacted
    assert got.completion_ids == want.completion_ids


def _cache_buffers_alive(slots: int) -> int:
    """Plain tensors alive of a static cache's layout [B, kv heads, slots, head dim]."""
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.dim() == 4 and o.shape[2] == slots)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_generation_leaves_no_cache_buffer_alive(fresh_dynamo, compiled):
    """Each call's KV cache is freed when it returns, by reference counting alone (the cyclic
    collector off): dynamo keeps the defaults of every function it traces, which held the cache
    of every compiled generation for the rest of the process, one cache more a call."""
    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa").eval()
    tok = load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    # 9 prompt tokens + 30 new: a cache of 48 slots, a shape no other tensor here has.
    decode = StaticDecode(max_new_tokens=30, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          do_sample=False, cuda_graphs=False, compile_step=compiled)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            decode.generate(model, prompts, keys)
            assert decode.last_call["compiled"] is compiled
            assert _cache_buffers_alive(48) == 0
    finally:
        gc.enable()
