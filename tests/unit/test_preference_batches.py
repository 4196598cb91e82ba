"""Padding-free and shared-prompt preference batches equal the padded, unshared computation.

Per-token log-probs (fused and unfused head), a DPO loss on them and every gradient, on
tiny Qwen2, Llama and Gemma 2 (fp32, CPU, to 1e-5); the layouts' labels and bookkeeping;
token budgets (an optimizer step split by budget equals one padded batch); the loss-aware
op fed per-position segments; the samplers and accelerate's sharding of them.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F

from fusedalign.attention import attention_inputs
from fusedalign.data import DataError, DPOCollator, position_labels, truncate_pair
from fusedalign.data.kto import KLPairCollator
from fusedalign.data.preference_batches import (
    PackedDPOCollator,
    PackedKTOCollator,
    dpo_row_tokens,
    kto_batch,
    kto_row_tokens,
    preference_batch,
    sequence_logps,
    valid_pairs,
)
from fusedalign.data.samplers import (
    LengthGroupedSampler,
    TokenBudgetBatchSampler,
    padded_tokens,
    plan_micro_batches,
)
from fusedalign.head import IGNORE_INDEX, token_logprobs
from fusedalign.models import load_model
from tests.head_calls import HeadCalls

BETA = 0.5
TOL = dict(rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ data


def _tokens(g: random.Random, n: int) -> list[int]:
    return [g.randrange(1, 512) for _ in range(n)]


def _random_rows(seed: int, n: int, prompt: tuple[int, int], completion: tuple[int, int]) -> list[dict]:
    g = random.Random(seed)
    return [{"prompt_ids": _tokens(g, g.randint(*prompt)), "chosen_ids": _tokens(g, g.randint(*completion)),
             "rejected_ids": _tokens(g, g.randint(*completion))} for _ in range(n)]


def _edge_rows() -> list[dict]:
    """One-token completions, a one-token prompt, no prompt, an empty completion, uneven lengths."""
    g = random.Random(7)
    return [
        {"prompt_ids": _tokens(g, 9), "chosen_ids": _tokens(g, 1), "rejected_ids": _tokens(g, 1)},
        {"prompt_ids": _tokens(g, 1), "chosen_ids": _tokens(g, 6), "rejected_ids": _tokens(g, 2)},
        {"prompt_ids": [], "chosen_ids": _tokens(g, 4), "rejected_ids": _tokens(g, 7)},
        {"prompt_ids": _tokens(g, 5), "chosen_ids": [], "rejected_ids": _tokens(g, 3)},
        {"prompt_ids": _tokens(g, 13), "chosen_ids": _tokens(g, 11), "rejected_ids": _tokens(g, 5)},
    ]


def _truncated_rows() -> list[dict]:
    """Long pairs cut as tokenisation cuts them (prompt kept at its end, then to max_length)."""
    rows = []
    for mode, row in zip(("keep_end", "keep_start", "keep_end"), _random_rows(3, 3, (20, 30), (8, 16))):
        prompt, (chosen, rejected), cut = truncate_pair(row["prompt_ids"], [row["chosen_ids"], row["rejected_ids"]],
                                                        max_prompt_length=12, max_length=20, truncation_mode=mode)
        assert cut
        rows.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
    return rows


ROWS = {
    "uneven": _edge_rows() + _random_rows(1, 3, (2, 10), (1, 8)),
    "truncated": _truncated_rows(),
    # Past tiny-gemma2's sliding window (64): its first layer must keep the window.
    "long": _random_rows(5, 3, (40, 60), (15, 30)),
}


@functools.lru_cache(maxsize=None)
def _model(name: str, attn: str):
    torch.manual_seed(0)
    return load_model(f"builtin:tiny-{name}", attn_implementation=attn)


MODELS = [("qwen2", "sdpa"), ("qwen2", "eager"), ("llama", "sdpa"), ("llama", "eager"),
          ("gemma2", "eager")]  # transformers has no sdpa for Gemma 2 (soft-capped attention)


# ------------------------------------------------------------------ the two computations


def _reference(rows: list[dict]) -> torch.Tensor:
    """A fixed reference log-prob per sequence [2B], so the loss is a real DPO loss."""
    g = torch.Generator().manual_seed(len(rows))
    return -5.0 * torch.rand(2 * len(rows), generator=g, dtype=torch.float64).float()


def _dpo_loss(sums: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """TRL's sigmoid DPO loss, mean over pairs: -log sigma(beta * (chosen ratio - rejected ratio))."""
    b = sums.shape[0] // 2
    ratio = sums - ref.to(sums.device)
    return -F.logsigmoid(BETA * (ratio[:b] - ratio[b:])).mean()


def _on(model, batch: dict) -> dict:
    device = next(model.parameters()).device
    return {k: v.to(device) for k, v in batch.items()}


def _padded(model, rows, fused):
    """Per sequence: (labels, log-probs of its scored tokens), the DPO loss; padded and unshared."""
    batch = _on(model, DPOCollator(pad_token_id=0)(rows))
    labels = position_labels(batch["input_ids"], batch["completion_mask"])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    logps = token_logprobs(model, inputs, targets=labels, fused=fused).logps  # [2B, T]
    per_seq = [(labels[s][labels[s] != IGNORE_INDEX], logps[s][labels[s] != IGNORE_INDEX]) for s in range(len(labels))]
    return per_seq, _dpo_loss(logps.double().sum(-1).float(), _reference(rows))


def _packed(model, rows, share, fused, **layout):
    batch = _on(model, preference_batch(rows, share_prompt=share, **layout))
    labels, seq = batch["labels"][0], batch["sequence_ids"][0]
    logps = token_logprobs(model, attention_inputs(model, batch), targets=batch["labels"], fused=fused).logps  # [1, L]
    per_seq = [(labels[seq == s], logps[0][seq == s]) for s in range(batch["scored_tokens"].shape[0])]
    return per_seq, _dpo_loss(sequence_logps(logps, batch), _reference(rows))


def _assert_same(model, expected, actual, tol=TOL):
    (want_seq, want_loss), (got_seq, got_loss) = expected, actual
    assert len(want_seq) == len(got_seq)
    for (want_labels, want_logps), (got_labels, got_logps) in zip(want_seq, got_seq):
        assert torch.equal(want_labels, got_labels)  # the same tokens scored, in the same order
        torch.testing.assert_close(got_logps, want_logps, **tol)
    torch.testing.assert_close(got_loss, want_loss, **tol)
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad(want_loss, params, allow_unused=True)
    got = torch.autograd.grad(got_loss, params, allow_unused=True)
    for p, w, g in zip(params, want, got):
        assert (w is None) == (g is None)
        if w is not None:
            torch.testing.assert_close(g, w, **tol)


# ------------------------------------------------------------------ model-level parity


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("share", [False, True], ids=["padding_free", "shared_prompt"])
@pytest.mark.parametrize("data", ["uneven", "truncated"])
@pytest.mark.parametrize("name, attn", MODELS)
def test_packed_rows_equal_padded_unshared(name, attn, data, share, fused):
    model = _model(name, attn)
    rows = ROWS[data]
    _assert_same(model, _padded(model, rows, fused), _packed(model, rows, share, fused))


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("share", [False, True], ids=["padding_free", "shared_prompt"])
def test_rows_longer_than_the_sliding_window_keep_it(share, fused):
    """tiny-gemma2's first layer has a 64-token window; these pairs reach position ~90."""
    model = _model("gemma2", "eager")
    rows = ROWS["long"]
    assert max(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows) > 64
    _assert_same(model, _padded(model, rows, fused), _packed(model, rows, share, fused))


@pytest.mark.parametrize("share", [False, True], ids=["padding_free", "shared_prompt"])
def test_padding_to_a_multiple_changes_nothing(share):
    model = _model("qwen2", "sdpa")
    rows = ROWS["uneven"]
    packed = _packed(model, rows, share, True, pad_to_multiple_of=64, pad_token_id=3)
    assert preference_batch(rows, share_prompt=share, pad_to_multiple_of=64)["input_ids"].shape[1] % 64 == 0
    _assert_same(model, _padded(model, rows, True), packed)


@pytest.mark.parametrize("share", [False, True], ids=["padding_free", "shared_prompt"])
def test_a_step_split_by_token_budget_equals_one_padded_batch(share):
    """Pairs of one step packed into budget-sized micro-batches; summed losses / all pairs of the step."""
    model = _model("llama", "sdpa")
    rows = ROWS["uneven"] + ROWS["truncated"]
    tokens = [dpo_row_tokens(r, share) for r in rows]
    sampler = TokenBudgetBatchSampler(tokens, max_tokens=64, seed=1)
    batches = list(sampler)
    assert 3 <= len(batches) < len(rows)  # several pairs a micro-batch, several micro-batches a step
    expected = _padded(model, rows, True)
    ref = _reference(rows)
    per_seq: dict[int, tuple] = {}
    loss = 0.0
    for members in batches:
        batch = preference_batch([rows[i] for i in members], share_prompt=share)
        assert batch["input_ids"].shape[1] == sum(tokens[i] for i in members) <= 64
        logps = token_logprobs(model, attention_inputs(model, batch), targets=batch["labels"]).logps
        sums = sequence_logps(logps, batch)
        b = len(members)
        index = torch.tensor(members + [len(rows) + i for i in members])  # this micro-batch's rows of the reference
        loss = loss + _dpo_loss(sums, ref[index]) * b / len(rows)  # the step's normaliser: all its pairs
        seq = batch["sequence_ids"][0]
        for s in range(2 * b):
            original = members[s % b] + (len(rows) if s >= b else 0)
            per_seq[original] = (batch["labels"][0][seq == s], logps[0][seq == s])
    _assert_same(model, expected, ([per_seq[s] for s in range(2 * len(rows))], loss))


@pytest.mark.parametrize("share", [False, True], ids=["padding_free", "shared_prompt"])
def test_the_loss_aware_op_takes_a_packed_row_as_segments_and_pair_groups(share):
    """What the fused loss-aware head needs for packed rows: per-position segments (`sequence_ids`)
    and one group per pair (`sequence_pair`); `RowLoss` (one sequence per batch row) cannot say it,
    since a row holds both sequences of a pair (and several pairs).

    At the op's level, on the hidden states the head receives (tiny-qwen2: final norm, untied head).
    """
    from fusedalign.ops import SequenceLoss, head_logprobs

    model = _model("qwen2", "sdpa")
    rows = ROWS["uneven"]
    ref = _reference(rows)
    expected = _padded(model, rows, False)
    batch = preference_batch(rows, share_prompt=share)
    hidden = model.model(**attention_inputs(model, batch), use_cache=False).last_hidden_state[0]  # [L, H]
    labels = batch["labels"][0]

    def grad(sums):
        sums = sums.detach().requires_grad_()
        return torch.autograd.grad(_dpo_loss(sums, ref.to(sums.dtype)), sums)[0]

    declared = SequenceLoss(batch["sequence_ids"][0], batch["sequence_pair"], grad)
    with HeadCalls() as calls:
        out = head_logprobs(hidden, model.lm_head.weight, labels, model.lm_head.bias, sequence_loss=declared,
                            backend="torch")
        assert out.loss_aware
        seq = batch["sequence_ids"][0]
        per_seq = [(labels[seq == s], out.logps[seq == s]) for s in range(2 * len(rows))]
        _assert_same(model, expected, (per_seq, _dpo_loss(sequence_logps(out.logps[None], batch), ref)))
    assert calls == {"forward": 1, "backward": 1}  # formed in the forward, and the declaration held


# ------------------------------------------------------------------ layouts


@pytest.mark.parametrize("share", [False, True], ids=["padding_free", "shared_prompt"])
def test_layout_labels_and_bookkeeping(share):
    rows = ROWS["uneven"]
    b = len(rows)
    batch = preference_batch(rows, share_prompt=share)
    padded = DPOCollator(pad_token_id=0)(rows)
    padded_labels = position_labels(padded["input_ids"], padded["completion_mask"])
    # The labels position_labels gives a packed row (never across a boundary), and the padded rows' tokens.
    assert torch.equal(batch["labels"], position_labels(batch["input_ids"], batch["completion_mask"],
                                                        position_ids=batch["position_ids"]))
    for s in range(2 * b):
        assert torch.equal(batch["labels"][0][batch["sequence_ids"][0] == s], padded_labels[s][padded_labels[s] >= 0])
    assert torch.equal((batch["labels"] != IGNORE_INDEX), batch["sequence_ids"] >= 0)
    assert batch["scored_tokens"].tolist() == (padded_labels != IGNORE_INDEX).sum(-1).tolist()
    assert batch["sequence_pair"].tolist() == list(range(b)) * 2
    assert batch["sequence_role"].tolist() == [0] * b + [1] * b
    assert batch["pair_tokens"].tolist() == [dpo_row_tokens(r, share) for r in rows]
    assert batch["sequence_tokens"].tolist() == padded["attention_mask"].sum(-1).tolist()  # num_tokens, any layout
    assert batch["input_ids"].shape[1] == sum(batch["pair_tokens"].tolist())
    assert valid_pairs(batch).tolist() == [bool(r["chosen_ids"]) and bool(r["rejected_ids"]) for r in rows]
    pair = rows[0]  # a 9-token prompt, one-token completions
    p = len(pair["prompt_ids"])
    if share:  # prefix at 0..p-2, then each branch opens with the last prompt token at p-1
        assert batch["input_ids"][0, :p + 3].tolist() == pair["prompt_ids"] + pair["chosen_ids"] + \
            pair["prompt_ids"][-1:] + pair["rejected_ids"]
        assert batch["position_ids"][0, :p + 3].tolist() == list(range(p + 1)) + [p - 1, p]
        assert batch["parent_ids"][0, p - 1:p + 3].tolist() == [0] * 4
    else:
        assert batch["position_ids"][0, :2 * p + 2].tolist() == list(range(p + 1)) * 2
        assert (batch["parent_ids"] == -1).all()


def test_kto_layouts_share_the_prompt_with_the_kl_partner():
    g = random.Random(11)
    rows = [{"prompt_ids": _tokens(g, p), "completion_ids": _tokens(g, c), "kl_completion_ids": _tokens(g, k),
             "label": bool(i % 2), "index": i} for i, (p, c, k) in enumerate([(6, 3, 1), (1, 4, 5), (0, 2, 2)])]
    out = PackedKTOCollator(share_prompt=True)(rows)
    assert out["label"].tolist() == [False, True, False] and out["index"].tolist() == [0, 1, 2]
    assert out["input_ids"].shape[1] == sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    assert out["kl_input_ids"].shape[1] == sum(len(r["prompt_ids"]) + len(r["kl_completion_ids"]) for r in rows)
    assert out["joint_pair_tokens"].tolist() == [kto_row_tokens(r, True) for r in rows] == [11, 11, 4]
    # The joint row scores the same tokens as the two separate rows: completion i, then KL partner i.
    for prefix, role in (("", 0), ("kl_", 1)):
        for i in range(len(rows)):
            alone = out[prefix + "labels"][0][out[prefix + "sequence_ids"][0] == i]
            joint = out["joint_labels"][0][out["joint_sequence_ids"][0] == role * len(rows) + i]
            scored = len(rows[i]["kl_completion_ids" if role else "completion_ids"]) - (not rows[i]["prompt_ids"])
            assert torch.equal(alone, joint) and len(alone) == scored
    unshared = kto_batch(rows)
    assert unshared["input_ids"].shape[1] == sum(kto_row_tokens(r, False) for r in rows)
    without_kl = [{k: v for k, v in r.items() if k != "kl_completion_ids"} for r in rows]
    assert "kl_input_ids" not in PackedKTOCollator()(without_kl)


@pytest.mark.parametrize("share", [False, True], ids=["padding_free", "shared_prompt"])
@pytest.mark.parametrize("name, attn", [("qwen2", "sdpa"), ("llama", "eager")])
def test_kto_joint_reference_row_equals_its_two_padded_rows(name, attn, share):
    """The reference's one forward over completions and KL partners (the prompt shared with
    share_prompt) equals the padded rows: each sequence's scored tokens and log-probs, their sums,
    and every parameter's gradient of the summed log-probs (a one-token prompt and completion, no
    prompt, an empty completion, uneven lengths)."""
    model = _model(name, attn)
    rows = [{"prompt_ids": r["prompt_ids"], "completion_ids": r["chosen_ids"], "kl_completion_ids": r["rejected_ids"]}
            for r in ROWS["uneven"]]
    batch = _on(model, kto_batch(rows, share_prompt=share))
    labels, seq = batch["labels"][0], batch["sequence_ids"][0]
    token_logps = token_logprobs(model, attention_inputs(model, batch), targets=batch["labels"]).logps
    joint = sequence_logps(token_logps, batch)  # [2B]: completions, then KL partners
    padded_rows = [{"prompt_ids": r["prompt_ids"], "chosen_ids": r["completion_ids"],
                    "rejected_ids": r["kl_completion_ids"]} for r in rows]
    padded = _on(model, DPOCollator(pad_token_id=0)(padded_rows))
    padded_labels = position_labels(padded["input_ids"], padded["completion_mask"])
    logps = token_logprobs(model, {"input_ids": padded["input_ids"], "attention_mask": padded["attention_mask"]},
                           targets=padded_labels).logps
    sums = logps.double().sum(-1).float()
    torch.testing.assert_close(joint, sums, **TOL)
    scored = padded_labels != IGNORE_INDEX
    expected = [(padded_labels[s][scored[s]], logps[s][scored[s]]) for s in range(2 * len(rows))]
    actual = [(labels[seq == s], token_logps[0][seq == s]) for s in range(2 * len(rows))]
    _assert_same(model, (expected, sums.sum()), (actual, joint.sum()))


def test_collator_passes_scalar_columns_and_refuses_bad_rows():
    rows = [dict(r, index=i, ref_chosen_logps=-1.5 * i) for i, r in enumerate(ROWS["uneven"][:3])]
    batch = PackedDPOCollator(share_prompt=True)(rows)
    assert batch["index"].tolist() == [0, 1, 2] and batch["ref_chosen_logps"].tolist() == [0.0, -1.5, -3.0]
    assert "row_key" not in batch
    # Row keys (precomputed reference log-probs) are the padded collators' own, so one store serves both.
    keyed = PackedDPOCollator(share_prompt=True, row_keys=True)(rows)["row_key"]
    assert torch.equal(keyed, DPOCollator(0, row_keys=True)(rows)["row_key"]) and len(set(keyed.tolist())) == 3
    kto_rows = [{"prompt_ids": r["prompt_ids"], "completion_ids": r["chosen_ids"], "kl_completion_ids": r["rejected_ids"],
                 "label": True} for r in rows]
    assert torch.equal(PackedKTOCollator(row_keys=True)(kto_rows)["row_key"],
                       KLPairCollator(0, row_keys=True)(kto_rows)["row_key"])
    with pytest.raises(DataError, match="row 1: missing column 'rejected_ids'"):
        preference_batch([rows[0], {"prompt_ids": [1], "chosen_ids": [2]}])
    with pytest.raises(DataError, match="at least one row"):
        preference_batch([])


# ------------------------------------------------------------------ samplers


def test_token_budget_sampler_packs_whole_examples_deterministically():
    tokens = [random.Random(i).randint(5, 60) for i in range(50)]
    first = TokenBudgetBatchSampler(tokens, max_tokens=100, seed=3)
    again = TokenBudgetBatchSampler(tokens, max_tokens=100, seed=3)
    assert list(first) == list(again)
    assert list(TokenBudgetBatchSampler(tokens, max_tokens=100, seed=4)) != list(first)
    batches = list(first)
    assert sorted(i for b in batches for i in b) == list(range(50))  # every example once
    assert all(sum(tokens[i] for i in b) <= 100 for b in batches)
    assert sum(tokens) / (100 * len(batches)) > 0.85  # packs densely
    first.set_epoch(1)
    assert len(list(first)) == len(first) == len(batches) and list(first) != batches  # new order, same count
    assert sorted(map(sorted, first)) == sorted(map(sorted, batches))
    ordered = plan_micro_batches(tokens, 100, range(50), open_batches=1)
    assert [i for b in ordered for i in b] == list(range(50))  # one open batch: the order, cut by the budget
    with pytest.raises(DataError, match="row 7: 61 tokens in a packed row, over max_tokens_per_batch=60"):
        TokenBudgetBatchSampler(tokens[:7] + [61], max_tokens=60)


@pytest.mark.parametrize("num_processes", [2, 4])
def test_every_rank_gets_the_same_micro_batches_per_step_under_accelerate_sharding(num_processes):
    from accelerate.data_loader import BatchSamplerShard

    tokens = [random.Random(i).randint(5, 60) for i in range(41)]
    plain = TokenBudgetBatchSampler(tokens, max_tokens=100, seed=0)
    sampler = TokenBudgetBatchSampler(tokens, max_tokens=100, seed=0, num_processes=num_processes)
    assert len(plain) % num_processes != 0  # the case that needs the split
    assert len(sampler) % num_processes == 0
    shards = [list(BatchSamplerShard(sampler, num_processes, rank)) for rank in range(num_processes)]
    assert len({len(s) for s in shards}) == 1
    dealt = [b for step in zip(*shards) for b in step]
    assert dealt == list(sampler)  # round-robin, nothing repeated: step s holds micro-batches s*K..(s+1)*K-1
    assert sorted(i for b in dealt for i in b) == list(range(41))
    with pytest.raises(DataError, match="cannot fill a micro-batch on each of 3 processes"):
        TokenBudgetBatchSampler([10, 10], max_tokens=100, num_processes=3)


def test_length_grouped_sampler_pads_less_and_keeps_batches_whole():
    g = random.Random(0)
    lengths = [int(g.lognormvariate(5.3, 0.6)) for _ in range(203)]
    sampler = LengthGroupedSampler(lengths, batch_size=8, seed=1, group_batches=10)
    order = list(sampler)
    assert sorted(order) == list(range(203))
    batches = [order[i:i + 8] for i in range(0, 203, 8)]  # how the DataLoader cuts it
    assert batches == sampler.batches()
    randomly = [list(range(203))[i:i + 8] for i in range(0, 203, 8)]
    assert padded_tokens(lengths, batches) < 0.8 * padded_tokens(lengths, randomly)
    sampler.set_epoch(1)
    assert list(sampler) != order
    assert list(LengthGroupedSampler(lengths, batch_size=8, seed=1, group_batches=10)) == order
