"""The flex-attention BlockMask of a packed row, built eagerly band by band (`attention.masks.block_mask`),
against PyTorch's `create_block_mask` over the same mask_mod: the same tables to the index."""

from __future__ import annotations

import random

import pytest
import torch

from fusedalign.attention.masks import block_mask, block_tables, visibility
from fusedalign.data.packed_rows import pack_groups

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _row(seed: int, share: bool, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Groups of uneven prompts and completions (one-token completions and empty-looking prompts included)."""
    rng = random.Random(seed)
    groups = []
    for _ in range(rng.randint(1, 4)):
        prompt = [rng.randint(3, 50) for _ in range(rng.randint(1, 40))]
        groups.append((prompt, [[rng.randint(3, 50) for _ in range(rng.choice([1, 2, 17, 33, 70]))] for _ in range(3)]))
    return pack_groups(groups, share_prompt=share, pad_to_multiple_of=pad_to)


def _rows(*rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Several packed rows as one [R, L] batch, shorter rows ended by a padding segment."""
    length = max(r["segment_ids"].shape[1] for r in rows)
    out = []
    for key, fill in (("segment_ids", None), ("parent_ids", -1), ("position_ids", 0)):
        cols = []
        for r in rows:
            t = r[key][0]
            pad = length - t.numel()
            value = int(t.max()) + 1 if fill is None else fill
            cols.append(torch.cat([t, torch.full((pad,), value, dtype=torch.long)]))
        out.append(torch.stack(cols))
    return tuple(out)


def _reference(segments, parents, positions, window, block):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        seen = (segments[b, k] == segments[b, q]) | (segments[b, k] == parents[b, q])
        seen = seen & (k <= q)
        if window is not None:
            seen = seen & (positions[b, q] - positions[b, k] < window)
        return seen

    length = segments.shape[1]
    return create_block_mask(mask_mod, B=segments.shape[0], H=None, Q_LEN=length, KV_LEN=length,
                             device=segments.device, BLOCK_SIZE=block)


CASES = [  # (seeds of the rows, share the prompt, window, block, pad_to_multiple_of)
    ((0,), True, None, 16, None),
    ((1,), False, None, 16, None),
    ((2, 3), True, None, 16, None),
    ((4, 5, 6), True, 20, 16, None),
    ((7,), True, None, 8, 8),  # a row ending on a block boundary: the last block can be full
    ((8, 9), False, 5, 32, None),
    ((10,), True, None, 128, None),  # flex attention's own block: one partial block
]


@pytest.mark.parametrize("seeds, share, window, block, pad_to", CASES)
@pytest.mark.parametrize("chunk", [1, 1 << 26])
def test_the_tables_equal_create_block_masks(seeds, share, window, block, pad_to, chunk):
    """Every table flex attention reads (kv and q, partial and full, counts and index order), the
    lengths, the block size and the dense mask equal `create_block_mask`'s, whether the tables are
    made one query block a band (chunk=1) or in one band."""
    segments, parents, positions = _rows(*[_row(s, share, pad_to) for s in seeds])
    ours = block_mask(segments, parents, positions, window, block_size=block, chunk_elements=chunk)
    ref = _reference(segments, parents, positions, window, block)
    assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    for field in FIELDS:
        assert torch.equal(getattr(ours, field), getattr(ref, field)), field
    assert torch.equal(ours.to_dense(), ref.to_dense())


def test_the_mask_mod_is_visibility():
    """What flex attention evaluates inside the partial blocks is `visibility`, pair by pair."""
    from torch.nn.attention.flex_attention import create_mask

    segments, parents, positions = _rows(_row(11, True), _row(12, True))
    for window in (None, 9):
        mask = block_mask(segments, parents, positions, window, block_size=16)
        dense = create_mask(mask.mask_mod, segments.shape[0], 1, segments.shape[1], segments.shape[1], "cpu")
        assert torch.equal(dense, visibility(segments, parents, positions, window))


def test_full_blocks_and_partial_blocks_are_exactly_the_visible_tiles():
    """From `visibility` directly: a tile is full when all its pairs are seen, partial when some are."""
    segments, parents, positions = _rows(_row(13, True), _row(14, False))
    block = 16
    partial, full = block_tables(segments, parents, positions, None, block_size=block, chunk_elements=1)
    seen = visibility(segments, parents, positions)[:, 0]
    rows, length = segments.shape
    blocks = -(-length // block)
    seen = torch.nn.functional.pad(seen, (0, blocks * block - length, 0, blocks * block - length))
    tiles = seen.view(rows, blocks, block, blocks, block).transpose(2, 3).flatten(3)
    assert torch.equal(full[:, 0], tiles.all(-1))
    assert torch.equal(partial[:, 0], tiles.any(-1) & ~tiles.all(-1))
    assert full.any() and partial.any() and not (full & partial).any()  # the row exercises both kinds


def test_a_band_holds_no_more_query_key_pairs_than_asked(monkeypatch):
    """The memory bound: each band evaluates at most `chunk_elements` pairs (or one query block of
    every row, the least a band can be), so a 65k-token row never holds its [L, L] mask."""
    import fusedalign.attention.masks as masks

    bands = []
    segments, parents, positions = _rows(_row(15, True), _row(16, True), _row(17, True))
    rows, length = segments.shape
    block = 8
    padded = -(-length // block) * block
    for chunk in (1, rows * padded * block * 3, rows * padded * block * 3 + 5, 1 << 30):
        sizes = []
        original = torch.Tensor.view

        def spy(self, *shape):
            if len(shape) == 5:
                sizes.append(self.numel())
            return original(self, *shape)

        monkeypatch.setattr(torch.Tensor, "view", spy)
        masks.block_tables(segments, parents, positions, None, block_size=block, chunk_elements=chunk)
        monkeypatch.setattr(torch.Tensor, "view", original)
        least = rows * padded * block
        assert sizes and max(sizes) <= max(chunk, least)
        assert sum(sizes) <= rows * padded * padded  # no pair evaluated twice
        bands.append(len(sizes))
    assert bands[0] == padded // block and bands[1] == bands[2] == -(-padded // (3 * block)) and bands[3] == 1


# ------------------------------------------------------------------ CUDA: what flex attention reads there


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [None, 20])
def test_on_cuda_the_tables_equal_create_block_masks(window):
    """The tables built on the GPU, at flex attention's own block of 128, equal `create_block_mask`'s
    (eager, on the GPU) for rows of several groups."""
    rows = [_row(s, True) for s in (20, 21)] + [pack_groups([([5] * 200, [[7] * 300] * 8)], share_prompt=True)]
    segments, parents, positions = (t.cuda() for t in _rows(*rows))
    ours = block_mask(segments, parents, positions, window)
    ref = _reference(segments, parents, positions, window, 128)
    for field in FIELDS:
        assert torch.equal(getattr(ours, field), getattr(ref, field)), field


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_65k_token_row_is_masked_in_bounded_memory():
    """One prompt shared by 8 completions of 8,192 tokens in one row (65,671 tokens): the mask is built
    without compiling anything and with a few bands' worth of memory above what it returns, where the
    whole [L, L] mask would be 4 GiB of booleans (and `create_block_mask`'s eager int64 work far more)."""
    row = pack_groups([([5] * 128, [[7] * 8192] * 8)], share_prompt=True)
    segments, parents, positions = (row[k].cuda() for k in ("segment_ids", "parent_ids", "position_ids"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    mask = block_mask(segments, parents, positions)
    torch.cuda.synchronize()
    rise = torch.cuda.max_memory_allocated() - before
    assert rise < 1 << 30, f"{rise / 2**20:.0f} MiB"
    blocks = -(-segments.shape[1] // 128)
    assert mask.kv_num_blocks.shape == (1, 1, blocks)
    # Each completion's query blocks see the prompt's block and their own causal blocks only.
    assert int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) < blocks * 80
