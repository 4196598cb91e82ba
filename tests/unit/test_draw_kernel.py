"""generation/draw_kernel.py: a sampled token drawn as argmax(logits / T + Gumbel noise) by one
Triton kernel, the noise made inside it.

Without noise the kernel must give `argmax(-1)`'s index exactly (the first of ties, within a
chunk, across its quarters and across chunks; 0 for a row all -inf); with noise its draws must
follow softmax(logits / T), fresh at every call, also replayed from a CUDA graph. On CPU the
kernel runs under Triton's interpreter (in a fresh process: tests/unit/test_ops_triton.py says
why), with small chunks, since each (row, chunk) is a program run in Python; on CUDA at
Qwen2.5-0.5B's vocabulary in bf16, where the statistics can be tight.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.unit.test_ops_triton import patch_interpreter, run_under_interpreter  # noqa: E402

CUDA = torch.cuda.is_available()


def test_filters_off_only_where_the_processors_only_divide_by_the_temperature():
    from fusedalign.generation.decode_state import filters_off

    off = dict(repetition_penalty=1.0, temperature=0.7, top_k=0, top_p=1.0, min_p=None)
    assert filters_off(off, 100)
    assert filters_off({**off, "top_k": 100}, 100) and filters_off({**off, "min_p": 0.0}, 100)
    for on in ({"top_k": 99}, {"top_p": 0.95}, {"min_p": 0.05}, {"repetition_penalty": 1.1}):
        assert not filters_off({**off, **on}, 100), on


def exact_cases():
    """(logits [B, V], chunk): ties inside a quarter, across quarters and across chunks, a last
    chunk cut short, a row all -inf, -inf next to finite values, a vocabulary under one chunk."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(7, 70, generator=g)
    z[1, 3] = z[1, 50] = 100.0  # across chunks (16 a chunk): the first
    z[2] = float("-inf")
    z[3, 17] = z[3, 18] = 50.0  # inside a quarter
    z[4, 19] = z[4, 23] = 50.0  # across the quarters of one chunk
    z[5, 66:] = 80.0  # in the last, short chunk
    z[6, :60] = float("-inf")
    return [(z, 16), (z[:, :11].contiguous(), 16), (z, 64), (z.bfloat16(), 32)]


@pytest.mark.skipif(CUDA, reason="CUDA present: the kernel is tested compiled, below")
def test_interpreted_draw_kernel():
    run_under_interpreter("tests.unit.test_draw_kernel", "interpreter_checks", "draw kernel checks passed")


def interpreter_checks():
    """Run in the subprocess above."""
    patch_interpreter()
    from fusedalign.generation.draw_kernel import chunk_draw, gumbel_draw

    for z, chunk in exact_cases():  # without noise: argmax's index, exactly
        for temperature in (1.0, 0.3) if chunk == 16 else (1.0,):
            got = chunk_draw(z, temperature, noise=False, chunk=chunk)
            assert torch.equal(got, z.float().argmax(-1)), (chunk, z.dtype, got, z.float().argmax(-1))
    # A strided view (a row of [B, 1, V] logits, say) reads as its contiguous copy.
    z = exact_cases()[0][0]
    assert torch.equal(chunk_draw(z.t().contiguous().t(), 1.0, noise=False, chunk=16), z.argmax(-1))
    # With noise: draws of softmax(z / T), tokens of interest in both chunks and several quarters,
    # the rest of the vocabulary at the float32 minimum (what the filters leave), never drawn.
    torch.manual_seed(0)
    want = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    where = torch.tensor([1, 7, 18, 31])
    rows, temperature = 200, 0.25
    z = torch.full((rows, 32), torch.finfo(torch.float32).min)
    z[:, where] = (want.log() * temperature).float()
    got = chunk_draw(z, temperature, chunk=16)
    counts = torch.bincount(got, minlength=32).double()
    assert counts.sum() == counts[where].sum() == rows, counts
    tv = 0.5 * (counts[where] / rows - want).abs().sum().item()
    assert tv < 0.09, (tv, counts[where])
    # Fresh noise a call: two calls on 32 rows of 16 equally likely tokens rarely agree.
    flat = torch.zeros(32, 16)
    agree = (chunk_draw(flat, 1.0, chunk=16) == chunk_draw(flat, 1.0, chunk=16)).double().mean().item()
    assert agree < 0.3, agree
    # The op: bf16 logits in, int64 tokens out, one per row; compiled by dynamo as one opaque op.
    from torch._dynamo.utils import counters

    z16 = torch.zeros(6, 40, dtype=torch.bfloat16)
    z16[:, 9] = 60.0
    out = gumbel_draw(z16, 0.7)
    assert out.dtype == torch.int64 and out.shape == (6,) and (out == 9).all()
    counters.clear()
    compiled = torch.compile(lambda logits: gumbel_draw(logits * 1.0, 0.7), dynamic=True)
    assert (compiled(z16) == 9).all() and (compiled(z16[:3]) == 9).all()
    assert not counters["graph_break"], dict(counters["graph_break"])
    print("draw kernel checks passed")


@pytest.mark.skipif(CUDA, reason="CUDA present: StaticDecode's sampled draws by the kernel are tested on it, below")
def test_static_decode_draws_sampled_tokens_by_the_kernel():
    run_under_interpreter("tests.unit.test_draw_kernel", "static_decode_checks", "static decode draw checks passed")


def static_decode_checks():
    """Run in the subprocess above: StaticDecode(decode_kernel="triton", do_sample=True) draws every
    token by the kernel, from the logits in the model's dtype divided by the temperature in it
    when no filter is on, from the processed float32 scores (temperature 1) when one is; greedy
    decoding and decode_kernel="sdpa" never call it."""
    patch_interpreter()
    from fusedalign.generation import StaticDecode, draw_kernel
    from fusedalign.models import load_model, load_tokenizer
    from tests.unit.test_static_decode import _keys, _prompts

    calls = []
    kernel = draw_kernel.gumbel_draw
    draw_kernel.gumbel_draw = lambda logits, t: calls.append((logits.dtype, t)) or kernel(logits, t)
    tok = load_tokenizer("builtin:tiny-qwen2")
    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    prompts = _prompts()[:3]
    base = dict(max_new_tokens=5, eos_token_id=-1, pad_token_id=tok.pad_token_id, temperature=0.7)
    for flags, want in (({}, (torch.bfloat16, 0.7)), ({"top_k": 20}, (torch.float32, 1.0))):
        calls.clear()
        decode = StaticDecode(**base, **flags, decode_kernel="triton")
        out = decode.generate(model, prompts, _keys(3))
        assert decode.last_call["draw_kernel"] is True and calls == [want] * 5, (flags, calls)
        assert all(len(c) == 5 and all(0 <= t < model.config.vocab_size for t in c) for c in out.completion_ids)
    for flags in ({"do_sample": False}, {"decode_kernel": "sdpa"}):
        calls.clear()
        decode = StaticDecode(**{**base, "decode_kernel": "triton", **flags})
        decode.generate(model, prompts, _keys(3))
        assert decode.last_call["draw_kernel"] is False and not calls, flags
    print("static decode draw checks passed")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_draw_without_noise_is_argmax():
    """At 512 rows of Qwen2.5-0.5B's 151,936 tokens in bf16 (ties in plenty) and in float32, and
    the small cases above: argmax's index, exactly."""
    from fusedalign.generation.draw_kernel import chunk_draw

    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        z = torch.randn(512, 151936, generator=g, device="cuda").to(dtype)
        assert torch.equal(chunk_draw(z, 1.0, noise=False), z.float().argmax(-1)), dtype
    for z, chunk in exact_cases():
        z = z.cuda()
        assert torch.equal(chunk_draw(z, 1.0, noise=False, chunk=chunk), z.float().argmax(-1)), (chunk, z.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_draws_in_a_graph_are_fresh_samples_of_the_softmax():
    """A CUDA graph captured around the op, replayed: 32,768 rows of a 151,936-token vocabulary in
    bf16 whose mass sits on 64 tokens spread over the chunks, divided by a temperature of 0.8.
    The draws of every replay follow softmax(logits / T) (total variation under 0.025) and each
    replay's are new (a row keeps its token across replays as often as independent draws do)."""
    from fusedalign.generation.draw_kernel import gumbel_draw

    vocab, rows, temperature = 151936, 32768, 0.8
    g = torch.Generator().manual_seed(0)
    where = torch.randperm(vocab, generator=g)[:64].cuda()
    b = torch.full((vocab,), -40.0, device="cuda")
    b[where] = torch.randn(64, generator=g).cuda() * 2
    logits = b.bfloat16().expand(rows, -1).contiguous()
    want = (logits[0].float() / temperature).double().softmax(-1)
    out = torch.empty(rows, dtype=torch.int64, device="cuda")

    def step():
        out.copy_(gumbel_draw(logits, temperature))

    step()  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    draws = []
    for _ in range(3):
        graph.replay()
        draws.append(out.clone())
        got = torch.bincount(out, minlength=vocab).double() / rows
        assert 0.5 * (got - want).abs().sum().item() < 0.025
    kept = (draws[0] == draws[1]).double().mean().item()
    assert abs(kept - (want ** 2).sum().item()) < 0.02, (kept, (want ** 2).sum().item())
