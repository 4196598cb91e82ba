"""generation/decode_kernel.py: one decoding step's grouped-query attention in Triton, against
attention computed by hand in float64.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, in a fresh process:
tests/unit/test_ops_triton.py says why); on CUDA it runs compiled, captured as a CUDA graph, at
Qwen2.5-0.5B's attention shape in bf16, held to erring no more than the grouped sdpa it would
replace (plus a small tolerance), against float32 arithmetic.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.unit.test_ops_triton import patch_interpreter, run_under_interpreter  # noqa: E402

CUDA = torch.cuda.is_available()

# (rows, query heads, key/value heads, head dim, slots, masked): left padding of every amount
# up to `masked` slots, or no mask (None).
CASES = {
    "qwen05_heads_one_share": (3, 14, 2, 64, 37, 20),
    "several_shares": (3, 14, 2, 64, 200, 160),  # 4 shares of 64 slots; a row's first shares all masked
    "no_mask": (2, 8, 2, 16, 70, None),
    "one_query_head_a_group": (2, 4, 4, 32, 50, 10),
    "eight_a_group": (2, 16, 2, 32, 65, 30),
}


def inputs(rows, heads, kv_heads, dim, slots, masked, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, heads, 1, dim, generator=g).to(dtype)
    key, value = (torch.randn(rows, kv_heads, slots, dim, generator=g).to(dtype) for _ in range(2))
    visible = None
    if masked is not None:
        visible = torch.ones(rows, slots, dtype=torch.bool)
        for row in range(rows):
            visible[row, : (row * masked) // max(1, rows - 1)] = False  # 0 up to `masked` slots hidden
    return query, key, value, visible


def by_hand(query, key, value, visible, scale):
    """float64: every query head against its key/value head."""
    q, k, v = (t.double() for t in (query, key, value))
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, h, 1, S]
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ v  # [B, h, 1, d]


def test_splits_fill_the_programs_and_never_cut_below_a_block():
    from fusedalign.generation.decode_kernel import BLOCK_N, splits_for

    assert splits_for(512, 2, 256, 528) == 1  # enough rows: one share each
    assert splits_for(64, 2, 256, 528) == 4  # 128 programs: 5 shares wanted, 4 blocks of slots
    assert splits_for(8, 2, 4096, 528) == 33  # 16 x 33 >= 528
    assert splits_for(8, 2, 2048, 528) == 32  # capped at 32 blocks of slots
    assert splits_for(8, 2, BLOCK_N - 1, 528) == 1
    assert splits_for(8, 2, 2048, 528, block_n=128) == 16  # capped at 16 blocks of 128


@pytest.mark.skipif(CUDA, reason="CUDA present: the kernel is tested compiled, below")
def test_interpreted_kernel_equals_attention_by_hand():
    run_under_interpreter("tests.unit.test_decode_kernel", "interpreter_checks", "decode kernel checks passed")


def interpreter_checks():
    """Run in the subprocess above: every case in float32 to 1e-5, then in bf16 (the probabilities
    rounded to bf16 before they weigh the values, as on the GPU) erring no more than the grouped
    sdpa in bf16 plus the GPU test's 2e-3, against float64."""
    patch_interpreter()
    from fusedalign.generation.decode_kernel import decode_attention

    for name, case in CASES.items():
        query, key, value, visible = inputs(*case)
        scale = case[3] ** -0.5
        got = decode_attention(query, key, value, visible, scale)
        want = by_hand(query, key, value, visible, scale)
        assert got.shape == query.shape and got.dtype == query.dtype, name
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # The cache's first slots only (the decoding step's window): a view, not a copy.
    query, key, value, visible = inputs(*CASES["several_shares"])
    wide_k, wide_v = (torch.cat([t, torch.full_like(t, float("nan"))], 2) for t in (key, value))
    got = decode_attention(query, wide_k[:, :, :200], wide_v[:, :, :200], visible, 0.125)
    torch.testing.assert_close(got.double(), by_hand(query, key, value, visible, 0.125), rtol=1e-5, atol=1e-5)
    # Other launches (benchmarks/decode_attention.py --triton_configs): other blocks of slots, so
    # other shares and a last block cut short, the same attention.
    from fusedalign.generation.decode_kernel import Launch, grouped_decode

    for launch in (Launch(32, 2, 3), Launch(128, 8, 4)):
        for name in ("several_shares", "eight_a_group"):
            case = CASES[name]
            query, key, value, visible = inputs(*case)
            got = grouped_decode(query, key, value, visible, case[3] ** -0.5, launch)
            torch.testing.assert_close(got.double(), by_hand(query, key, value, visible, case[3] ** -0.5),
                                       rtol=1e-5, atol=1e-5, msg=lambda m, n=name, c=launch: f"{n} {c}: {m}")
    # Masked slots skipped (their keys and values never loaded): the same attention, and slots
    # that hold NaN behind the mask (a cache's unwritten or stale slots) change nothing.
    skip = Launch(skip_masked=True)
    for name, case in CASES.items():
        query, key, value, visible = inputs(*case)
        scale = case[3] ** -0.5
        want = by_hand(query, key, value, visible, scale)
        got = grouped_decode(query, key, value, visible, scale, skip)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"skip {n}: {m}")
        if visible is not None:
            stale_k, stale_v = (t.masked_fill(~visible[:, None, :, None], float("nan")) for t in (key, value))
            for launch in (skip, Launch(32, 2, 3, True)):
                got = grouped_decode(query, stale_k, stale_v, visible, scale, launch)
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, n=name, c=launch: f"NaN behind the mask, {n} {c}: {m}")
            # The op's default launch skips them too (what StaticDecode's steps run).
            got = decode_attention(query, stale_k, stale_v, visible, scale)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"NaN behind the mask, the default launch, {n}: {m}")
    for name, case in CASES.items():
        query, key, value, visible = inputs(*case, dtype=torch.bfloat16)
        scale = case[3] ** -0.5
        got = decode_attention(query, key, value, visible, scale)
        assert got.dtype == torch.bfloat16, name
        truth = by_hand(query, key, value, visible, scale)
        ours, sdpa = (error_of(out, truth) for out in (got, grouped_sdpa(query, key, value, visible, scale)))
        assert ours <= sdpa + 2e-3, (name, ours, sdpa)
    print("decode kernel checks passed")


def grouped_sdpa(query, key, value, visible, scale):
    """What StaticDecode runs without the kernel: a group's query heads as query positions."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    mask = visible[:, None, None, :] if visible is not None else None
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(rows, kv_heads, heads // kv_heads, dim), key, value, attn_mask=mask, scale=scale)
    return out.reshape(rows, heads, 1, dim)


def error_of(out, truth):
    return (out.double() - truth).abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("skip_masked", [False, True])
@pytest.mark.parametrize("rows,slots", [(512, 384), (64, 2048), (5, 129)])
def test_cuda_kernel_in_a_graph_errs_no_more_than_the_grouped_sdpa(rows, slots, skip_masked):
    """bf16 at Qwen2.5-0.5B's heads (14 over 2, d 64): replayed from a CUDA graph, the kernel's
    largest error against float32 arithmetic is at most the grouped sdpa's plus 2e-3, with the
    masked slots' keys and values read or not (`Launch.skip_masked`)."""
    from fusedalign.generation.decode_kernel import Launch, grouped_decode

    def decode_attention(query, key, value, visible, scale):
        return grouped_decode(query, key, value, visible, scale, Launch(skip_masked=skip_masked))

    query, key, value, visible = (t.cuda() if t is not None else None for t in
                                  inputs(rows, 14, 2, 64, slots, slots // 2, dtype=torch.bfloat16))
    scale = 0.125
    truth = by_hand(query.float(), key.float(), value.float(), visible, scale).float()
    out = torch.empty_like(query)

    def step():
        out.copy_(decode_attention(query, key, value, visible, scale))

    step()  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.zero_()
    graph.replay()
    grouped = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(rows, 2, 7, 64), key, value, attn_mask=visible[:, None, None, :], scale=scale)
    ours_error = (out.float() - truth).abs().max().item()
    sdpa_error = (grouped.reshape(rows, 14, 1, 64).float() - truth).abs().max().item()
    assert ours_error <= sdpa_error + 2e-3, (ours_error, sdpa_error)


def test_static_decode_refuses_an_unknown_kernel():
    from fusedalign.generation import StaticDecode

    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        StaticDecode(max_new_tokens=4, eos_token_id=0, pad_token_id=0, decode_kernel="cudnn")


def test_auto_is_the_triton_kernels_on_cuda_and_the_grouped_sdpa_elsewhere(monkeypatch):
    """decode_kernel="auto", StaticDecode's and --decode_kernel's default: "triton" on a CUDA device
    where Triton is installed, "sdpa" on the CPU (under Triton's interpreter too) or without
    Triton; "sdpa" and "triton" asked for by name are themselves on any device. On the CPU the
    default loop then decodes through the grouped sdpa and draws no token by the draw kernel."""
    import importlib.util

    from fusedalign.generation import StaticDecode
    from fusedalign.generation.decode_attention import GROUPED, kernel_for
    from fusedalign.models import load_model, load_tokenizer

    assert StaticDecode(max_new_tokens=4, eos_token_id=0, pad_token_id=0).decode_kernel == "auto"
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    real = importlib.util.find_spec
    for installed in (True, False):  # Triton installed, then not
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, on=installed: (
            (real("torch") if on else None) if name == "triton" else real(name, *a)))
        assert kernel_for("auto", cuda) == ("triton" if installed else "sdpa")
        assert kernel_for("auto", cpu) == "sdpa"
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert kernel_for("auto", cpu) == "sdpa"
        monkeypatch.delenv("TRITON_INTERPRET")
        named = [kernel_for(k, d) for k in ("sdpa", "triton") for d in (cuda, cpu)]
        assert named == ["sdpa", "sdpa", "triton", "triton"]
    monkeypatch.undo()

    tok = load_tokenizer("builtin:tiny-qwen2")
    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa").eval()
    prompts, keys = [[5, 6, 7], [8, 9]], [(0, 0), (1, 0)]
    decode = StaticDecode(max_new_tokens=3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    decode.generate(model, prompts, keys)
    assert decode.last_call["decode_kernel"] == "sdpa" and decode.last_call["attention"] == GROUPED
    assert decode.last_call["draw_kernel"] is False


@pytest.mark.skipif(CUDA, reason="CUDA present: StaticDecode with the kernel is tested compiled, below")
def test_static_decode_with_the_kernel_decodes_as_with_the_grouped_sdpa():
    run_under_interpreter("tests.unit.test_decode_kernel", "static_decode_checks", "static decode checks passed")


def static_decode_checks():
    """Run in the subprocess above: StaticDecode(decode_kernel="triton") on tiny-qwen2 and tiny-llama
    (sdpa; 4 query heads over 2, d 16), greedy with a repetition penalty, windows of 4 slots and a
    compaction: the grouped sdpa's tokens, every decoding step's attention through the kernel."""
    patch_interpreter()
    from fusedalign.generation import StaticDecode, decode_kernel
    from fusedalign.generation.decode_attention import GROUPED_TRITON
    from fusedalign.models import load_model, load_tokenizer
    from tests.unit.test_static_decode import PROMPT_LENGTHS, _keys, _prompts

    calls = []
    kernel = decode_kernel.decode_attention
    decode_kernel.decode_attention = lambda *args: calls.append(args[1].shape[2]) or kernel(*args)
    tok = load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    for name in ("builtin:tiny-qwen2", "builtin:tiny-llama"):
        model = load_model(name, attn_implementation="sdpa").eval()
        kw = dict(max_new_tokens=10, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False,
                  repetition_penalty=1.3, window_slots=4, compact_below=0.9, check_every=2)
        first = StaticDecode(**kw, decode_kernel="sdpa").generate(model, prompts, keys).completion_ids
        kw["eos_token_id"] = first[2][1]  # one row ends early: the batch compacts
        want = StaticDecode(**kw, decode_kernel="sdpa").generate(model, prompts, keys)
        calls.clear()
        decode = StaticDecode(**kw, decode_kernel="triton")
        got = decode.generate(model, prompts, keys)
        assert decode.last_call["attention"] == GROUPED_TRITON and len(decode.last_call["batch_sizes"]) >= 2
        assert got.completion_ids == want.completion_ids and got.truncated == want.truncated, name
        layers = model.config.num_hidden_layers
        assert len(calls) == layers * (decode.last_call["steps"] - 1), (name, len(calls))  # every step, every layer
        assert max(calls) < max(PROMPT_LENGTHS) + 10  # the written slots only, not the whole cache
    print("static decode checks passed")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("compiled,fused", [(False, False), (True, False), (True, True)])
def test_cuda_graph_decoding_with_the_kernel_equals_the_grouped_sdpa(compiled, fused):
    """float32, 0.5B-like heads (4 over 2 of 64, vocabulary 151,936): StaticDecode's CUDA graphs with
    the kernel (the step compiled by inductor, or not; the draw in the head, or not) give the
    grouped sdpa's greedy tokens over several windows, and after weights changed in place."""
    from fusedalign.generation import StaticDecode
    from fusedalign.models import load_tokenizer
    from tests.unit.test_static_decode import PROMPT_LENGTHS, _cuda_model, _keys, _prompts

    tok = load_tokenizer("builtin:tiny-qwen2")
    model = _cuda_model()
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    kw = dict(max_new_tokens=40, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False,
              repetition_penalty=1.3, window_slots=16)
    for _ in range(2):
        want = StaticDecode(**kw, decode_kernel="sdpa").generate(model, prompts, keys)
        assert want.completion_ids and StaticDecode(**kw).kernel_on(model) == "triton"  # "auto" on CUDA
        decode = StaticDecode(**kw, decode_kernel="triton", compile_step=compiled, fused_sampling=fused)
        got = decode.generate(model, prompts, keys)
        assert decode.last_call["graph"] is True and decode.last_call["graphs"] >= 3
        assert decode.last_call["compiled"] is compiled and decode.last_call["fused_sampling"] is fused
        assert decode.last_call["attention"] == "fusedalign_grouped_triton"
        assert got.completion_ids == want.completion_ids
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)


@pytest.mark.skipif(CUDA, reason="CUDA present: the compiled step with the kernel is tested in the CUDA test's setting")
def test_a_compiled_step_takes_the_kernel_as_one_op():
    run_under_interpreter("tests.unit.test_decode_kernel", "compiled_checks", "compiled checks passed")


def compiled_checks():
    """Run in the subprocess above: StaticDecode(compile_step=True, decode_kernel="triton") compiles
    the step once, with no graph break (the kernel is a `torch.library` op dynamo does not trace
    into), and gives the grouped sdpa's greedy tokens; so does it with the draw inside the head
    (fused_sampling), which breaks the graph where the head's forward is swapped."""
    patch_interpreter()
    from torch._dynamo.utils import counters

    from fusedalign.generation import StaticDecode
    from fusedalign.models import load_model, load_tokenizer
    from tests.unit.test_static_decode import PROMPT_LENGTHS, _keys, _prompts

    tok = load_tokenizer("builtin:tiny-qwen2")
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))
    model = load_model("builtin:tiny-qwen2", attn_implementation="sdpa").eval()
    kw = dict(max_new_tokens=5, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False,
              repetition_penalty=1.3)
    want = StaticDecode(**kw, decode_kernel="sdpa").generate(model, prompts, keys)
    for fused in (False, True):  # the draw from the logits, then inside the head
        torch._dynamo.reset()
        counters.clear()
        decode = StaticDecode(**kw, decode_kernel="triton", compile_step=True, fused_sampling=fused)
        got = decode.generate(model, prompts, keys)
        assert decode.last_call["compiled"] is True and decode.last_call["attention"] == "fusedalign_grouped_triton"
        assert decode.last_call["fused_sampling"] is fused
        if not fused:  # (the sampling head swaps the head's forward inside the step: dynamo breaks there)
            assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
        assert got.completion_ids == want.completion_ids, fused
    print("compiled checks passed")


def test_what_the_kernel_does_not_take_goes_to_the_grouped_sdpa():
    from fusedalign.generation.decode_kernel import supports

    query, key, value, _ = inputs(*CASES["qwen05_heads_one_share"])
    assert supports(query, key, value) is None
    assert "head dimension 48" in supports(query[..., :48], key[..., :48], value[..., :48])
    assert "autocast" in supports(query.bfloat16(), key, value)
    assert "contiguous" in supports(query, key.transpose(-1, -2).contiguous().transpose(-1, -2), value)
    assert "query heads" in supports(query[:, :13], key, value)
