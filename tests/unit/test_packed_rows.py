"""The one row layout (`fusedalign.data.packed_rows`), prompt groups on their own: packing of
groups into rows up to a token budget, the attention structure (each completion sees its
prompt and itself), and per-sequence sums equal to the padded layout's, on tiny-qwen2 with
eager attention and (forward only, on CPU) flex attention."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import random

import pytest
import torch

from fusedalign.attention import attention_inputs, visibility
from fusedalign.data import DataError
from fusedalign.data.packed_rows import PackedRows, group_tokens, pack_prompt_groups, segment_sums
from fusedalign.head import token_logprobs
from fusedalign.models import load_model

TOL = dict(rtol=1e-5, atol=1e-5)
G = 3  # completions per prompt

ROOT = Path(__file__).resolve().parents[2]


def _groups(n: int = 6, seed: int = 0) -> list[tuple[list[int], list[list[int]]]]:
    """Prompt groups of uneven lengths (a one-token prompt and a one-token completion included)."""
    g = random.Random(seed)
    ids = lambda k: [g.randrange(1, 512) for _ in range(k)]  # noqa: E731
    groups = [(ids(g.randint(2, 9)), [ids(g.randint(1, 7)) for _ in range(G)]) for _ in range(n)]
    groups[1] = (ids(1), [ids(1)] + [ids(4) for _ in range(G - 1)])
    return groups


def test_a_prompt_group_row_shares_the_prompt_and_continues_its_positions():
    prompt, completions = [11, 12, 13, 14], [[21, 22], [31], [41, 42, 43]]
    [(members, rows)] = pack_prompt_groups([(prompt, completions)], max_tokens=64)
    assert members == [0]
    # prefix prompt[:-1] at 0..2, then per completion the last prompt token and the completion at 3..
    assert rows.input_ids[0].tolist() == [11, 12, 13, 14, 21, 22, 14, 31, 14, 41, 42, 43]
    assert rows.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 3, 4, 5, 6]
    assert rows.segment_ids[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3]
    assert rows.parent_ids[0].tolist() == [-1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert rows.labels[0].tolist() == [-100, -100, -100, 21, 22, -100, 31, -100, 41, 42, 43, -100]
    assert rows.sequence_ids[0].tolist() == [-1, -1, -1, 0, 0, -1, 1, -1, 2, 2, 2, -1]
    assert rows.scored_tokens.tolist() == [2, 1, 3] and rows.sequence_group.tolist() == [0, 0, 0]
    assert rows.sequence_tokens.tolist() == [6, 5, 7] and int(rows.input_tokens()) == 18
    assert rows.forward_tokens() == 12 == group_tokens(4, [2, 1, 3], share_prompt=True)
    # Each completion's positions see the prompt (prefix + its own copy of the last token) and
    # its own earlier tokens, nothing of a sibling.
    seen = visibility(rows.segment_ids, rows.parent_ids, rows.position_ids)[0, 0]
    prefix, branches = [0, 1, 2], [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    for branch in branches:
        for q in branch:
            want = prefix + [k for k in branch if k <= q]
            assert seen[q].nonzero().flatten().tolist() == want, q


def test_groups_fill_rows_up_to_the_budget_whole_and_each_once():
    groups = _groups(n=12)
    sizes = [group_tokens(len(p), [len(c) for c in cs], True) for p, cs in groups]
    budget = 2 * max(sizes)
    packed = pack_prompt_groups(groups, budget)
    assert sorted(i for members, _ in packed for i in members) == list(range(12))
    assert len(packed) < 12  # several groups share a row
    for members, rows in packed:
        assert rows.forward_tokens() == sum(sizes[i] for i in members) <= budget
        b = len(members)
        assert rows.num_sequences == G * b and rows.sequence_group.tolist() == list(range(b)) * G
        for i, member in enumerate(members):  # completion k of the row's i-th group is sequence k * b + i
            for k, completion in enumerate(groups[member][1]):
                assert int(rows.scored_tokens[k * b + i]) == len(completion)
    with pytest.raises(DataError, match=rf"group \d+: {max(sizes)} tokens in a packed row, over the budget of "
                                        rf"{max(sizes) - 1} tokens"):
        pack_prompt_groups(groups, max(sizes) - 1)


def _padded_sums(model, groups) -> dict[tuple[int, int], torch.Tensor]:
    """{(group, completion): summed completion log-probs}, each prompt + completion a padded row."""
    seqs = [(i, k, p + c, len(p)) for i, (p, cs) in enumerate(groups) for k, c in enumerate(cs)]
    width = max(len(ids) for _, _, ids, _ in seqs)
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention, completion = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for r, (_, _, ids, p) in enumerate(seqs):
        input_ids[r, :len(ids)] = torch.tensor(ids)
        attention[r, :len(ids)] = 1
        completion[r, p:len(ids)] = 1
    rows = PackedRows.from_padded(input_ids, attention, completion)
    with torch.no_grad():
        sums = rows.sums(token_logprobs(model, rows.model_inputs(model), targets=rows.labels, fused=False).logps)
    return {(i, k): sums[r] for r, (i, k, _, _) in enumerate(seqs)}


def _packed_sums(model, groups, budget: int) -> dict[tuple[int, int], torch.Tensor]:
    """Every row padded to the budget: one shape (on CPU, flex attention's kernel compiled for a
    second row length fails to build in torch's inductor, a C++ compile error)."""
    out = {}
    for members, rows in pack_prompt_groups(groups, budget, pad_to_multiple_of=budget):
        with torch.no_grad():
            sums = rows.sums(token_logprobs(model, rows.model_inputs(model), targets=rows.labels).logps)  # fused head
        b = len(members)
        for i, member in enumerate(members):
            for k in range(G):
                out[member, k] = sums[k * b + i]
    return out


@pytest.mark.parametrize("attn", ["eager", "flex_attention"])
def test_per_sequence_sums_of_packed_prompt_groups_equal_the_padded_rows(attn, tmp_path):
    """Flex attention's forward runs on CPU (its backward needs CUDA: tests/unit/test_attention.py).

    On CPU its kernel is checked in a process and an inductor cache of its own, on rows whose
    length is a multiple of its blocks (see `check_prompt_group_sums`)."""
    if attn == "eager":
        check_prompt_group_sums(attn)
        return
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = f"from tests.unit.test_packed_rows import check_prompt_group_sums; check_prompt_group_sums({attn!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def check_prompt_group_sums(attn: str) -> None:
    """Packed prompt groups' per-sequence sums on `attn` equal the padded rows' on eager attention."""
    from torch.nn.attention.flex_attention import BlockMask

    torch.manual_seed(0)
    model = load_model("builtin:tiny-qwen2", attn_implementation=attn)
    groups = _groups()
    budget = 3 * max(group_tokens(len(p), [len(c) for c in cs], True) for p, cs in groups)
    if attn == "flex_attention":
        # Rows a multiple of flex attention's 128-token blocks: on CPU, rows of other lengths gave
        # NaN sums in 2 runs of 3 on 2026-12-04 (the block mask's mask_mod is then asked about
        # positions past the row's end; reading them clamped made it 1 in 4: not understood yet).
        budget = -(-budget // 128) * 128
    [(_, rows), *_] = pack_prompt_groups(groups, budget, pad_to_multiple_of=budget)
    mask = rows.model_inputs(model)["attention_mask"]
    assert isinstance(mask, BlockMask) == (attn == "flex_attention")
    assert rows.model_inputs(model) is rows.model_inputs(model)  # built once per row and model
    packed, padded = _packed_sums(model, groups, budget), _padded_sums(load_model("builtin:tiny-qwen2",
                                                                                  attn_implementation="eager"), groups)
    assert packed.keys() == padded.keys()
    got, want = torch.stack([packed[key] for key in padded]), torch.stack(list(padded.values()))
    torch.testing.assert_close(got, want, **TOL)
    assert want.abs().min() > 1e-2  # real sums, not zeros


def test_control_without_the_shared_prompt_mask_the_sums_differ():
    """A packed row given restarting-free positions and no mask lets completions see their siblings."""
    torch.manual_seed(0)
    model = load_model("builtin:tiny-qwen2", attn_implementation="eager")
    groups = _groups(n=2)
    [(_, rows)] = pack_prompt_groups(groups, 10_000)
    kwargs = attention_inputs(model, {k: getattr(rows, k) for k in ("input_ids", "position_ids", "segment_ids",
                                                                     "parent_ids")})
    with torch.no_grad():
        right = rows.sums(token_logprobs(model, kwargs, targets=rows.labels, fused=False).logps)
        wrong = rows.sums(token_logprobs(model, {"input_ids": rows.input_ids, "position_ids": rows.position_ids},
                                         targets=rows.labels, fused=False).logps)
    assert float((right - wrong).abs().max()) > 1e-3


def test_padded_rows_sum_by_row_and_by_segment_alike():
    """One sequence a row: the row sums (as the loss-aware head sums such rows) equal the segment sums."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, 100, (4, 9), generator=g)
    attention = torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [1] * 2 + [0] * 7, [1] * 8 + [0]])
    completion = attention.clone()
    completion[:, :3] = 0
    rows = PackedRows.from_padded(input_ids, attention, completion, per_group=2)
    assert rows.scored_tokens.tolist() == [6, 3, 0, 5] and rows.sequence_group.tolist() == [0, 1, 0, 1]
    assert rows.sequence_tokens.tolist() == [9, 6, 2, 8] and rows.model_inputs(None)["attention_mask"] is attention
    values = torch.randn(4, 9, generator=g) * (rows.labels != -100)
    torch.testing.assert_close(rows.sums(values), segment_sums(values, rows.sequence_ids, 4), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rows.sums(values), values.sum(-1), rtol=1e-6, atol=1e-6)
