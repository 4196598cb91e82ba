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


@pytest.mark.skipif(CUDA, reason="CUDA present: the kernel is tested compiled, below")
def test_interpreted_kernel_equals_attention_by_hand():
    run_under_interpreter("tests.unit.test_decode_kernel", "interpreter_checks", "decode kernel checks passed")


def interpreter_checks():
    """Run in the subprocess above: every case in float32 to 1e-5. (bf16 only on CUDA: Triton 3.6's
    interpreter multiplies bf16 blocks in `tl.dot` as their raw bits.)"""
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
    print("decode kernel checks passed")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("rows,slots", [(512, 384), (64, 2048), (5, 129)])
def test_cuda_kernel_in_a_graph_errs_no_more_than_the_grouped_sdpa(rows, slots):
    """bf16 at Qwen2.5-0.5B's heads (14 over 2, d 64): replayed from a CUDA graph, the kernel's
    largest error against float32 arithmetic is at most the grouped sdpa's plus 2e-3."""
    from fusedalign.generation.decode_kernel import decode_attention

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
