"""The decoding step's two-stage argmax picks exactly the index `argmax(-1)` picks: the first maximum."""

from __future__ import annotations

import pytest
import torch

from fusedalign.generation.decode_state import ARGMAX_CHUNK, row_argmax

# Qwen2.5's vocabulary (37 whole chunks and a tail), whole chunks only, one chunk and a tail, under two chunks.
WIDTHS = [151936, 4 * ARGMAX_CHUNK, ARGMAX_CHUNK + 5, 2 * ARGMAX_CHUNK - 1, 100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", WIDTHS)
def test_random_rows(width, dtype):
    g = torch.Generator().manual_seed(width)
    scores = torch.randn(9, width, generator=g).to(dtype)
    assert torch.equal(row_argmax(scores), scores.argmax(-1))


@pytest.mark.parametrize("width", WIDTHS)
def test_ties_keep_the_first_maximum(width):
    """Equal maxima in two chunks, at a chunk's last and first token, in the tail, in one chunk twice."""
    places = [(0, width - 1), (ARGMAX_CHUNK - 1, ARGMAX_CHUNK), (width - 2, width - 1), (5, 7), (width // 2, width - 1)]
    scores = torch.zeros(len(places) + 1, width)  # the last row all equal: index 0
    for row, (a, b) in enumerate(places):
        scores[row, [min(a, width - 1), min(b, width - 1)]] = 3.0
    got, want = row_argmax(scores), scores.argmax(-1)
    assert torch.equal(got, want)
    assert want[-1] == 0


def test_minus_infinity_and_nan_as_argmax():
    """Filtered tokens (the dtype's minimum, -inf noise) and a NaN, which argmax takes as the maximum."""
    width = 151936
    scores = torch.randn(5, width)
    scores[0] = float("-inf")
    scores[1, : width - 10] = float("-inf")  # only the tail lives
    scores[2] = torch.finfo(torch.float32).min
    scores[2, 2 * ARGMAX_CHUNK + 3] = 0.0
    scores[3, 9000] = float("nan")
    scores[3, 100] = 50.0
    scores[4, [3, width - 3]] = float("nan")
    assert torch.equal(row_argmax(scores), scores.argmax(-1))


def test_a_view_of_wider_scores():
    """Scores that are a slice of a wider tensor (a padded vocabulary) are read in place."""
    wide = torch.randn(6, 151936 + 64)
    scores = wide[:, :151936]
    assert not scores.is_contiguous()
    assert torch.equal(row_argmax(scores), scores.argmax(-1))


def test_compiled_equals_argmax():
    """As the compiled decoding step runs it: inductor's kernels for the two stages."""
    scores = torch.randn(8, 151936)
    scores[:, 1000] = scores[:, 150000] = 10.0  # a tie across chunks, and the tail
    compiled = torch.compile(row_argmax, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(scores), scores.argmax(-1))
