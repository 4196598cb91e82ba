"""GRPO and RLOO on packed rows (`padding_free`, `share_prompt`, `max_tokens_per_batch`): the plan of
micro-batches, and training equal to padded unfused training for every loss type, with beta > 0,
num_iterations 2, uneven completions (one-token and truncated ones, in the loss with
mask_truncated_completions off, out of it with it on) and a budget just above the longest group;
gradient checkpointing (and its offload) on packed rows changes nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from datasets import Dataset

from fusedalign.configs import GRPOConfig, RLOOConfig
from fusedalign.data import load_dataset_any
from fusedalign.data.formats import DataError
from fusedalign.data.grpo_packing import OVER_BUDGET, pack_completions, plan_micro_batches
from fusedalign.data.packed_rows import group_tokens
from fusedalign.data.prompts import prepare_prompt_dataset
from fusedalign.generation import Replay
from fusedalign.models import load_model, load_tokenizer
from fusedalign.trainers.grpo import GRPOTrainer
from fusedalign.trainers.grpo_packed_batch import PackedGRPOMicroBatch, PackedGRPOParts
from fusedalign.trainers.rloo import RLOOTrainer
from tests.grpo_replay import token_sum_reward, uneven_replay
from tests.micro_batches import record_micro_batches

MODEL = "builtin:tiny-qwen2"
ROWS, G = 16, 4
LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
COMPARED = ("loss", "reward", "reward_std", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min",
            "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean", "cispo_clip_ratio",
            "vespo/phi_seq_mean", "num_tokens", "completions/mean_length")


@pytest.fixture(scope="module")
def prompts() -> Dataset:
    return load_dataset_any("builtin:zen", "standard_prompt_only").select(range(ROWS))


@pytest.fixture(scope="module")
def replay():
    # Every 3rd completion truncated (no EOS), lengths 1..11: one-token completions, with and without EOS.
    return uneven_replay(ROWS, G, load_tokenizer(MODEL).eos_token_id, truncate_every=3)


@pytest.fixture(scope="module")
def replay_with_eos_only(replay):
    """The replay with completion (0, 1) only an EOS: the first generation holds it and the one-token
    truncated completion (0, 0)."""
    records = dict(replay.records)
    records[(0, 1)] = ([load_tokenizer(MODEL).eos_token_id], False, None)
    assert records[(0, 0)][1] and len(records[(0, 0)][0]) == 1
    return Replay(records)


@pytest.fixture(scope="module")
def longest_group(prompts, replay) -> int:
    """Tokens of the longest prompt group in a shared-prompt row."""
    rows, _ = prepare_prompt_dataset(prompts, load_tokenizer(MODEL))
    return max(group_tokens(len(rows[r]["prompt_ids"]), [len(replay.records[(r, g)][0]) for g in range(G)], True)
               for r in range(ROWS))


def _train(tmp_path, prompts, replay, trainer_cls=GRPOTrainer, config_cls=GRPOConfig, peft_config=None, **overrides):
    values = dict(
        output_dir=str(tmp_path), max_steps=4, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, num_generations=G, max_completion_length=12, logging_steps=1,
        save_strategy="no", seed=0, report_to="none", disable_tqdm=True, shuffle_dataset=False, beta=0.04,
        num_iterations=2, mask_truncated_completions=True,
    )
    values.update(overrides)
    torch.manual_seed(0)
    trainer = trainer_cls(load_model(MODEL), reward_funcs=token_sum_reward, args=config_cls(**values),
                          train_dataset=prompts, generator=replay, peft_config=peft_config)
    seen = record_micro_batches(trainer)  # per micro-batch: the batch and its advantages
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, seen, initial


@pytest.fixture(scope="module")
def longest_completion(prompts, replay) -> int:
    """Tokens of the longest prompt + a completion of max_completion_length (12; the replay's are 1 to 12):
    the smallest budget the trainer takes."""
    rows, _ = prepare_prompt_dataset(prompts, load_tokenizer(MODEL))
    assert max(len(replay.records[(r, g)][0]) for r in range(ROWS) for g in range(G)) == 12
    return max(len(rows[r]["prompt_ids"]) for r in range(ROWS)) + 12


def _step_advantages(seen) -> list[list[float]]:
    """Each optimizer step's advantages, sorted (packing may move completions between its micro-batches)."""
    return [sorted(float(a) for b in step for a in b.advantages) for step in seen.by_step()]


def _loss_tokens(seen) -> list[list[int]]:
    """Each optimizer step's per-completion loss-token counts, sorted."""
    return [sorted(int(n) for b in step for n in b.loss_mask.sum(-1)) for step in seen.by_step()]


def _assert_loss_tokens(seen, replay, mask_truncated: bool):
    """Step s trains generation s // 2 (2 prompts x G, rows 2 (s // 2) and the next, num_iterations 2): its
    completions' loss tokens are their lengths, EOS included; 0 for a truncated one when masked."""
    steps = _loss_tokens(seen)
    for s, got in enumerate(steps):
        records = [replay.records[(r, g)] for r in (2 * (s // 2), 2 * (s // 2) + 1) for g in range(G)]
        assert got == sorted(0 if truncated and mask_truncated else len(ids) for ids, truncated, _ in records), s


def _assert_same_training(packed, padded, steps: int = 4):
    assert len(packed[0]) == len(padded[0]) >= steps
    for step, (a, b) in enumerate(zip(packed[0], padded[0])):
        assert set(a) == set(b)
        for key in COMPARED:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (step, key)
    assert any(e.get("kl", 0) > 0 for e in padded[0])  # beta > 0 reached the loss
    packed_steps, padded_steps = _step_advantages(packed[2]), _step_advantages(padded[2])
    assert len(packed_steps) == len(padded_steps) >= steps
    for a, b in zip(packed_steps, padded_steps):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    for key, value in padded[1].items():
        torch.testing.assert_close(packed[1][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert any(not torch.equal(v, padded[3][k]) for k, v in padded[1].items())  # training moved the weights


def _assert_packed(seen, budget: int | None):
    assert all(isinstance(b, PackedGRPOMicroBatch) for b in seen)
    assert all(bool((b.rows.parent_ids >= 0).any()) for b in seen)  # prompts shared in every row
    if budget is not None:
        assert max(b.rows.forward_tokens() for b in seen) <= budget


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_packed_shared_prompt_grpo_equals_padded_unfused(tmp_path, prompts, replay, longest_group, loss_type):
    """A budget just above the longest group: each step's two groups are regrouped whole, one a row. bnpo's
    micro-batches keep their completions (its mean is per micro-batch), regrouped by prompt within, in
    parts where they do not fit one row."""
    budget = longest_group + 1
    padded = _train(tmp_path / "p", prompts, replay, loss_type=loss_type, fused_head=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed = _train(tmp_path / "k", prompts, replay, loss_type=loss_type, padding_free=True, share_prompt=True,
                        max_tokens_per_batch=budget)
    _assert_same_training(packed, padded)
    _assert_packed(packed[2], budget)
    _assert_loss_tokens(padded[2], replay, mask_truncated=True)
    _assert_loss_tokens(packed[2], replay, mask_truncated=True)
    if loss_type != "bnpo":
        assert all(len(set(b.rows.sequence_group.tolist())) == 1 for b in packed[2])  # one group a row
        assert len(packed[2]) == len(padded[2])  # one row a micro-batch


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_over_the_budget_train_in_parts_equal_to_padded_unfused(tmp_path, prompts, replay,
                                                                              longest_completion, loss_type):
    """A budget just above the longest prompt + completion: a step's 8 completions need more rows than
    its 2 forwards, so each micro-batch is trained as several rows, one forward and backward each, no
    row over the budget: the same training as padded micro-batches, no warning."""
    budget = longest_completion + 1
    padded = _train(tmp_path / "p", prompts, replay, loss_type=loss_type, fused_head=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed = _train(tmp_path / "k", prompts, replay, loss_type=loss_type, padding_free=True, share_prompt=True,
                        max_tokens_per_batch=budget)
    _assert_same_training(packed, padded)
    _assert_packed(packed[2], budget)
    _assert_loss_tokens(packed[2], replay, mask_truncated=True)
    assert len(packed[2]) > len(padded[2])  # more forwards than micro-batches


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_unmasked_one_token_and_truncated_completions_train_in_parts_equal_to_padded(
        tmp_path, prompts, replay_with_eos_only, longest_completion, loss_type):
    """mask_truncated_completions off (TRL's default): the first generation's EOS-only completion, its
    one-token truncated one and its longer truncated ones are in the loss, and training on them packed
    in parts (a budget just above one completion: rows of a few completions) equals padded training,
    on-policy and off-policy (2 steps, to keep the time down)."""
    replay, budget = replay_with_eos_only, longest_completion + 1
    common = dict(loss_type=loss_type, mask_truncated_completions=False, max_steps=2)
    padded = _train(tmp_path / "p", prompts, replay, fused_head=False, **common)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed = _train(tmp_path / "k", prompts, replay, padding_free=True, share_prompt=True,
                        max_tokens_per_batch=budget, **common)
    _assert_same_training(packed, padded, steps=2)
    _assert_packed(packed[2], budget)
    assert len(packed[2]) > len(padded[2])  # more forwards than micro-batches
    for run in (padded, packed):
        _assert_loss_tokens(run[2], replay, mask_truncated=False)
        assert all(tokens[:2] == [1, 1] for tokens in _loss_tokens(run[2]))  # the two one-token completions


def test_the_entropy_bonus_in_parts_equals_padded(tmp_path, prompts, replay, longest_completion):
    """entropy_coef: the bonus's weight (the step's token count, all micro-batches) reaches every part."""
    common = dict(loss_type="grpo", entropy_coef=0.05)
    padded = _train(tmp_path / "p", prompts, replay, fused_head=False, **common)
    packed = _train(tmp_path / "k", prompts, replay, padding_free=True, share_prompt=True,
                    max_tokens_per_batch=longest_completion, **common)
    _assert_same_training(packed, padded)
    assert len(packed[2]) > len(padded[2]) and all(b.entropy_weight is not None for b in packed[2])


def test_lora_on_the_head_in_parts_equals_padded(tmp_path, prompts, replay, longest_completion):
    """LoRA on q, v and lm_head, beta > 0 with the reference the policy with its adapter disabled: the
    reference's pass and the policy's run per part."""
    from peft import LoraConfig

    def lora():
        return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "v_proj", "lm_head"])

    padded = _train(tmp_path / "p", prompts, replay, fused_head=False, peft_config=lora())
    packed = _train(tmp_path / "k", prompts, replay, padding_free=True, share_prompt=True,
                    max_tokens_per_batch=longest_completion, peft_config=lora())
    _assert_same_training(packed, padded)
    assert len(packed[2]) > len(padded[2]) and any("lora" in k for k in packed[1])


def test_top_entropy_quantile_keeps_each_micro_batch_in_one_forward(tmp_path, prompts, replay, longest_completion):
    """Its threshold is a quantile over a whole micro-batch's entropies (every rank's), so a micro-batch
    over the budget stays one row, with a warning, and training equals padded training."""
    common = dict(loss_type="dapo", top_entropy_quantile=0.5)
    padded = _train(tmp_path / "p", prompts, replay, fused_head=False, **common)
    with pytest.warns(UserWarning, match="max_tokens_per_batch: top_entropy_quantile"):
        packed = _train(tmp_path / "k", prompts, replay, padding_free=True, share_prompt=True,
                        max_tokens_per_batch=longest_completion, **common)
    _assert_same_training(packed, padded)
    assert len(packed[2]) == len(padded[2]) and max(b.rows.forward_tokens() for b in packed[2]) > longest_completion


def test_a_budget_that_cannot_hold_the_longest_prompt_and_a_whole_completion_is_refused(tmp_path, prompts, replay,
                                                                                       longest_completion):
    with pytest.raises(DataError, match=rf"row \d+ \(from 0\): its prompt of \d+ tokens and a completion of up to "
                                        rf"max_completion_length=12 need {longest_completion} tokens in a packed row, "
                                        rf"over max_tokens_per_batch={longest_completion - 1}; raise"):
        _train(tmp_path, prompts, replay, padding_free=True, max_tokens_per_batch=longest_completion - 1)
    assert not any(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.parametrize("parts", [False, True], ids=["rows", "parts"])
def test_a_window_over_several_optimizer_steps_keeps_each_steps_completions(tmp_path, prompts, replay,
                                                                           longest_completion, parts):
    """steps_per_generation 4, accumulation 2: completions move only within a step's micro-batches (also
    when a budget of one completion trains them in parts)."""
    common = dict(loss_type="dapo", per_device_train_batch_size=2, steps_per_generation=4, max_steps=4)
    budget = dict(max_tokens_per_batch=longest_completion) if parts else {}
    padded = _train(tmp_path / "p", prompts, replay, fused_head=False, **common)
    packed = _train(tmp_path / "k", prompts, replay, padding_free=True, share_prompt=True, **budget, **common)
    _assert_same_training(packed, padded)
    assert (len(packed[2]) > len(padded[2])) == parts


@pytest.mark.parametrize("parts", [False, True], ids=["rows", "parts"])
def test_packed_shared_prompt_rloo_equals_padded_unfused(tmp_path, prompts, replay, longest_group, longest_completion,
                                                         parts):
    """A budget just above the longest group (one row a micro-batch), or just above one completion (in parts).
    Truncated completions in the loss: each off-policy step (num_iterations 2) clips some sequences and
    not others, so its gradient is not 0 and the packed log-ratios must match the padded ones, not merely
    fall on the same side of the clip."""
    budget = (longest_completion if parts else longest_group) + 1
    common = dict(trainer_cls=RLOOTrainer, config_cls=RLOOConfig, beta=0.05, mask_truncated_completions=False)
    padded = _train(tmp_path / "p", prompts, replay, fused_head=False, **common)
    packed = _train(tmp_path / "k", prompts, replay, padding_free=True, share_prompt=True,
                    max_tokens_per_batch=budget, **common)
    _assert_same_training(packed, padded)
    _assert_packed(packed[2], budget)
    _assert_loss_tokens(packed[2], replay, mask_truncated=False)
    for run in (padded, packed):
        off_policy = [e for e in run[0] if "reward" not in e]  # the steps that do not generate
        assert len(off_policy) == 2
        for e in off_policy:
            assert e["grad_norm"] > 0 and 0 < e["clip_ratio/region_mean"] < 1, e
    for a, b in zip(packed[0], padded[0]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-6)
    assert (len(packed[2]) > len(padded[2])) == parts  # parts: more forwards than micro-batches


OFFLOAD = pytest.param({"offload": True}, id="offload", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="transformers' offload pins host memory, which needs an accelerator")])


@pytest.mark.parametrize("kwargs", [pytest.param({}, id="checkpointing"), OFFLOAD])
def test_gradient_checkpointing_on_packed_rows_changes_nothing(tmp_path, prompts, replay, longest_completion,
                                                               kwargs):
    """On micro-batches in parts (a budget just above one completion): each part's recomputed forward."""
    common = dict(padding_free=True, share_prompt=True, max_tokens_per_batch=longest_completion + 1, loss_type="dapo")
    plain = _train(tmp_path / "a", prompts, replay, **common)
    checkpointed = _train(tmp_path / "c", prompts, replay, gradient_checkpointing=True,
                          gradient_checkpointing_kwargs=kwargs or None, **common)
    _assert_same_training(checkpointed, plain)


# ---------------------------------------------------------------------- the plan and the row


def _flat(batch: list[list[int]]) -> list[int]:
    return [i for row in batch for i in row]


def test_plan_keeps_the_forward_count_and_each_chunks_completions():
    groups = [i // 4 for i in range(16)]
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist()
    lengths = [1 + (7 * i) % 11 for i in range(16)]
    plan = plan_micro_batches(order, 4, 2, groups, [5] * 16, lengths, share_prompt=True, budget=None,
                              keep_membership=False)
    assert len(plan) == 4 and all(len(batch) == 1 for batch in plan)  # one row each
    for c in (0, 2):
        assert sorted(_flat(plan[c]) + _flat(plan[c + 1])) == sorted(order[4 * c:4 * c + 8])
    kept = plan_micro_batches(order, 4, 2, groups, [5] * 16, lengths, share_prompt=True, budget=None,
                              keep_membership=True)
    assert [len(b) for b in kept] == [1] * 4  # each padded micro-batch's completions, regrouped by prompt
    assert [sorted(b[0]) for b in kept] == [sorted(order[i:i + 4]) for i in range(0, 16, 4)]


def test_plan_fills_the_budget_and_trains_what_a_step_cannot_hold_in_parts():
    groups, lengths = [i // 2 for i in range(8)], [3] * 8
    size = group_tokens(4, [3, 3], True)  # one group: 4 - 1 + 2 x 4 = 11 tokens
    row = lambda r: group_tokens(4, [3] * len(r), True)  # noqa: E731  (rows of one group here)

    def plan(micro, chunk, budget, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return plan_micro_batches(list(range(8)), micro, chunk, groups, [4] * 8, lengths, share_prompt=True,
                                      budget=budget, **{"keep_membership": False, **kwargs})

    fits = plan(2, 4, 2 * size)
    assert [len(b) for b in fits] == [1] * 4 and all(len(b[0]) == 2 for b in fits)  # 2 bins split into 4 rows
    # 4 groups of one budget each, 2 forwards: each micro-batch is 2 rows, one group each.
    parts = plan(4, 2, size)
    assert [len(b) for b in parts] == [2, 2] and sorted(_flat(sum(parts, []))) == list(range(8))
    assert all(sorted(groups[i] for i in r) == [groups[r[0]]] * 2 for b in parts for r in b)
    # Another rank needs 6 rows: this one splits its rows to as many, 3 a micro-batch, none over the budget.
    asked = []
    more = plan(4, 2, size, rows_needed=lambda rows: asked.append(rows) or [6])
    assert asked == [[4]] and [len(b) for b in more] == [3, 3]
    assert sorted(_flat(sum(more, []))) == list(range(8)) and max(row(r) for b in more for r in b) <= size
    # The rows are dealt fullest first to the lightest micro-batch: the two have equal loads here.
    assert sum(row(r) for r in more[0]) == sum(row(r) for r in more[1])
    # A loss defined per micro-batch (bnpo) keeps each micro-batch's completions, in parts when over.
    order = [0, 4, 1, 5, 2, 6, 3, 7]  # each padded micro-batch: two completions of each of two groups
    kept = plan(4, 2, size, keep_membership=True)
    assert [sorted(_flat(b)) for b in plan(4, 2, 4 * size, keep_membership=True)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [sorted(_flat(b)) for b in kept] == [[0, 1, 2, 3], [4, 5, 6, 7]] and [len(b) for b in kept] == [2, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixed = plan_micro_batches(order, 4, 2, groups, [4] * 8, lengths, share_prompt=True, budget=size,
                                   keep_membership=True)
    assert [sorted(_flat(b)) for b in mixed] == [[0, 1, 4, 5], [2, 3, 6, 7]]  # the padded cut, regrouped within
    # top_entropy_quantile's threshold needs each micro-batch in one forward: kept as it is, with a warning.
    with pytest.warns(UserWarning, match="max_tokens_per_batch: top_entropy_quantile"):
        whole = plan_micro_batches(order, 4, 2, groups, [4] * 8, lengths, share_prompt=True, budget=size,
                                   keep_membership=True, one_row=True)
    assert whole == [[[0, 4, 1, 5]], [[2, 6, 3, 7]]]
    assert OVER_BUDGET.startswith("max_tokens_per_batch")


def test_a_micro_batch_in_parts_cuts_its_advantages_and_carries_its_loss_tokens_in_every_part():
    def part(prompts, completions, groups):
        rows, positions = pack_completions(prompts, completions, groups, [True] * len(completions), share_prompt=True)
        return PackedGRPOMicroBatch(rows, positions, torch.zeros(len(completions)))

    a, b = part([[1, 2, 3]] * 2, [[4, 5], [6]], [0, 0]), part([[7, 8]], [[9, 10, 11]], [1])
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        PackedGRPOParts((a, b))
    batch = PackedGRPOParts.of([a, b])
    assert [int(p.micro_batch_tokens) for p in batch.parts] == [6, 6] and batch.sizes == [2, 1]
    assert batch.loss_mask.tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    batch = batch.replace(advantages=torch.tensor([0.5, -1.0, 2.0]), entropy_weight=torch.tensor(0.1))
    assert [p.advantages.tolist() for p in batch.parts] == [[0.5, -1.0], [2.0]]
    assert all(float(p.entropy_weight) == pytest.approx(0.1) for p in batch.parts)
    back = PackedGRPOParts.from_state(batch.state())
    assert [p.advantages.tolist() for p in back.parts] == [[0.5, -1.0], [2.0]]
    assert [int(p.micro_batch_tokens) for p in back.parts] == [6, 6] and back.forward_tokens() == batch.forward_tokens()


def test_packed_completions_read_back_per_completion():
    rows, positions = pack_completions([[1, 2, 3], [1, 2, 3], [4, 5]], [[6, 7], [8], [9, 10, 11]], [0, 0, 1],
                                       [True, True, False], share_prompt=True)
    assert rows.input_ids.tolist() == [[1, 2, 3, 6, 7, 3, 8, 4, 5, 9, 10, 11]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1, 2, 3, 4]]
    flat = rows.labels.reshape(-1)
    assert [[int(flat[p]) for p in row if p >= 0] for row in positions.tolist()] == [[6, 7], [8], []]
    assert rows.sequence_tokens.tolist() == [5, 4, 5] and rows.sequence_group.tolist() == [0, 0, 1]


def test_packed_flags_are_checked_when_the_config_is_made(tmp_path):
    with pytest.raises(ValueError, match="share_prompt computes each prompt once"):
        GRPOConfig(output_dir=str(tmp_path), share_prompt=True)
    with pytest.raises(ValueError, match="max_tokens_per_batch=16 cannot hold one completion"):
        GRPOConfig(output_dir=str(tmp_path), padding_free=True, max_tokens_per_batch=16, max_prompt_length=8,
                   max_completion_length=12)
    with pytest.raises(ValueError, match="add --padding_free true"):
        RLOOConfig(output_dir=str(tmp_path), max_tokens_per_batch=64)
