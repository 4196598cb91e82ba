"""GRPO's generation state across restarts and evaluation: a run resumed from any checkpoint (at a
window's end or in its middle, num_iterations 2, keyed or unkeyed sampling) logs exactly the
uninterrupted run's steps and ends on its weights; evaluation on or off changes nothing of
training; each split is formatted as itself; the typed micro-batch refuses a missing part."""

from __future__ import annotations

import json

import pytest
import torch

from fusedalign.configs import GRPOConfig
from fusedalign.data import load_dataset_any
from fusedalign.models import load_model
from fusedalign.trainers.base import CheckpointError
from fusedalign.trainers.grpo import GRPOTrainer
from fusedalign.trainers.grpo_batch import GRPOMicroBatch, MissingPartError
from fusedalign.trainers.grpo_rollout import GRPORollout
from tests.grpo_replay import token_sum_reward

MODEL = "builtin:tiny-qwen2"
# Logged per step and compared exactly (the completions and the maths are the same).
COMPARED = ("loss", "reward", "reward_std", "completions/mean_length", "entropy", "clip_ratio/region_mean", "kl")


def _prompts(split: str = "train", config: str = "standard_prompt_only", rows: int = 16):
    return load_dataset_any("builtin:zen", config, split=split).select(range(rows))


def _train(out, *, resume=None, eval_dataset=None, reward=token_sum_reward, **overrides):
    values = dict(output_dir=str(out), max_steps=4, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                  warmup_steps=0, max_grad_norm=0.0, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, num_iterations=2, beta=0.1, keyed_sampling=True, logging_steps=1,
                  save_strategy="steps", save_steps=1, seed=0, report_to="none", disable_tqdm=True,
                  per_device_eval_batch_size=4)
    values.update(overrides)
    args = GRPOConfig(**values)
    torch.manual_seed(0)
    trainer = GRPOTrainer(load_model(MODEL), reward_funcs=reward, args=args, train_dataset=_prompts(),
                          eval_dataset=eval_dataset)
    trainer.train(resume_from_checkpoint=resume)
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    return trainer, logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_same(got_logs, want_logs, got_weights, want_weights, steps):
    for step in steps:
        for key in COMPARED:
            if key in want_logs[step]:
                assert got_logs[step][key] == want_logs[step][key], (step, key, got_logs[step][key],
                                                                     want_logs[step][key])
    for name, value in want_weights.items():
        assert torch.equal(got_weights[name], value), name


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
def test_resumed_from_every_checkpoint_equals_the_uninterrupted_run(tmp_path, keyed):
    """num_iterations 2: windows of steps (1, 2) and (3, 4); checkpoint-1 and -3 lie inside a window
    (its completions and old-policy log-probs must come from the checkpoint), -2 at a window's end."""
    straight, want, weights = _train(tmp_path / "straight", keyed_sampling=keyed)
    assert straight.generation_step == 2
    assert want[2]["clip_ratio/region_mean"] >= 0 and want[2]["loss"] != want[1]["loss"]
    for checkpoint in (1, 2, 3):
        out = tmp_path / f"from{checkpoint}"
        _train(out, keyed_sampling=keyed, max_steps=checkpoint)  # the run that stopped there
        resumed, got, got_weights = _train(out, keyed_sampling=keyed,
                                           resume=str(out / f"checkpoint-{checkpoint}"))
        assert resumed.generation_step == 2
        _assert_same(got, want, got_weights, weights, range(checkpoint + 1, 5))


@pytest.mark.parametrize("micro, budget, kind", [(2, 96, "PackedGRPOMicroBatch"), (4, 16, "PackedGRPOParts")],
                         ids=["rows", "parts"])
def test_packed_rows_resume_inside_a_window_as_the_uninterrupted_run(tmp_path, micro, budget, kind):
    """Packed shared-prompt rows under a token budget, num_iterations 2: checkpoint-1 lies inside
    a window, whose packed micro-batches (rows, per-completion read-back, old-policy and reference
    log-probs) must come back from the checkpoint; with a budget below a micro-batch's tokens, each
    micro-batch is in parts of one row each, which come back as parts."""
    packed = dict(padding_free=True, share_prompt=True, max_tokens_per_batch=budget, gradient_accumulation_steps=2,
                  per_device_train_batch_size=micro)
    straight, want, weights = _train(tmp_path / "straight", **packed)
    out = tmp_path / "from1"
    _train(out, max_steps=1, **packed)
    window = torch.load(out / "checkpoint-1" / "fusedalign_rank0.pt", weights_only=False)["grpo_rollout"]["window"]
    assert window is not None and window["served"] == 2  # stopped inside the window: 2 of its 4 servings
    resumed, got, got_weights = _train(out, resume=str(out / "checkpoint-1"), **packed)
    assert {type(b).__name__ for b in resumed.rollout.window.batches} == {kind}
    _assert_same(got, want, got_weights, weights, range(2, 5))


def test_a_checkpoint_holds_the_window_in_progress(tmp_path):
    _train(tmp_path, max_steps=1)
    state = torch.load(tmp_path / "checkpoint-1" / "fusedalign_rank0.pt", weights_only=False)["grpo_rollout"]
    assert state["generations"] == 1 and state["window"]["served"] == 1 and state["window"]["uses"] == 2
    batch = state["window"]["batches"][0]
    assert batch["old_logps"].shape == batch["labels"].shape and batch["ref_logps"] is not None


def test_a_window_in_progress_written_by_other_ranks_is_refused():
    rollout = GRPORollout.__new__(GRPORollout)
    state = {"generations": 3, "window": {"batches": [], "uses": 2, "served": 1}}
    with pytest.raises(CheckpointError, match="same number of processes"):
        rollout.load_state_dict(state, same_ranks=False)
    rollout.load_state_dict({"generations": 3, "window": None}, same_ranks=False)  # a window's end: fine
    assert rollout.generations == 3 and rollout.window is None


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
def test_evaluation_changes_nothing_of_training(tmp_path, keyed):
    _, want, weights = _train(tmp_path / "plain", keyed_sampling=keyed, save_strategy="no")
    trainer, got, got_weights = _train(tmp_path / "eval", keyed_sampling=keyed, save_strategy="no",
                                       eval_dataset=_prompts("test", rows=4), eval_strategy="steps", eval_steps=1)
    assert sum("eval_reward" in e for e in trainer.state.log_history) == 4  # evaluation did run, each step
    _assert_same(got, want, got_weights, weights, range(1, 5))


def test_each_split_is_formatted_as_itself(tmp_path):
    """A standard train split and a conversational eval split: training rewards get strings,
    evaluation rewards get assistant messages."""
    seen = {"str": 0, "messages": 0}

    def reward(completions, **kwargs):
        for c in completions:
            seen["str" if isinstance(c, str) else "messages"] += 1
        return [0.1 * (i % 3) for i in range(len(completions))]

    _train(tmp_path, reward=reward, max_steps=2, save_strategy="no",
           eval_dataset=_prompts("test", "conversational_prompt_only", rows=4), eval_strategy="steps", eval_steps=2)
    assert seen == {"str": 4, "messages": 4 * 4}  # one window of 1 prompt x 4; one evaluation of 4 prompts x 4


def _printed_tables(out: str) -> list[list[list[str]]]:
    """The completion tables in printed output: each a header and rows, cells stripped."""
    tables, lines = [], out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("step ") and " | " in line:
            body = []
            for row in lines[i + 2:]:  # below the header's rule
                if " | " not in row:
                    break
                body.append([cell.strip() for cell in row.split(" | ")])
            tables.append([[cell.strip() for cell in line.split(" | ")], *body])
    return tables


def test_log_completions_prints_a_table_and_keeps_every_completion(tmp_path, capsys):
    """Every completion is kept in completions.jsonl with each reward function's value for it (computed
    again here: token_sum_reward from the ids it was given, vowels from the row's text); the table has
    exactly TRL's columns and the first num_completions_to_print rows of each logging step."""
    import functools

    from fusedalign.rewards import BUILTIN_REWARDS

    given = []  # (completion text, completion ids), in the order the rewards see them

    @functools.wraps(token_sum_reward)
    def recording(completions, completion_ids, **kwargs):
        given.extend(zip(completions, completion_ids))
        return token_sum_reward(completion_ids)

    vowels = BUILTIN_REWARDS["vowels"]()
    _train(tmp_path, reward=[recording, vowels], max_steps=2, num_iterations=1, save_strategy="no",
           log_completions=True, num_completions_to_print=3)
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 and [r["step"] for r in rows] == [1] * 4 + [2] * 4  # a group of 4 a step
    assert set(rows[0]) == {"step", "prompt", "completion", "rewards", "advantage"}
    assert len(given) == len(rows)
    for row, (text, ids) in zip(rows, given):  # (the rewards travel in float32)
        assert row["completion"] == text
        assert row["rewards"] == pytest.approx({"token_sum_reward": token_sum_reward([ids])[0],
                                                "vowels": vowels([row["completion"]])[0]}, rel=1e-6, abs=1e-7)
    assert len({r["rewards"]["vowels"] for r in rows}) > 1 and len({r["completion"] for r in rows}) > 1
    for group in (rows[:4], rows[4:]):  # one prompt's group: advantages centred on its mean reward
        assert len({r["prompt"] for r in group}) == 1
        assert sum(r["advantage"] for r in group) == pytest.approx(0.0, abs=1e-6)
    tables = _printed_tables(capsys.readouterr().out)
    assert len(tables) == 2  # one at each of the 2 logging steps
    for step, table in enumerate(tables, 1):
        assert table[0] == ["step", "prompt", "completion", "token_sum_reward", "vowels", "advantage"]
        assert len(table) == 1 + 3  # a header and the first 3 of the step's 4 rows
        shown = rows[4 * (step - 1):4 * (step - 1) + 3]
        assert [r[0] for r in table[1:]] == [str(step)] * 3
        assert [r[-3:] for r in table[1:]] == [[f"{v:.4g}" for v in (*r["rewards"].values(), r["advantage"])]
                                               for r in shown]


def test_log_completions_from_the_command_line(tmp_path, capsys):
    """`fusedalign grpo --log_completions --num_completions_to_print 2` (the demo, one step): the flags
    are TRL's names on the CLI, the table shows 2 rows, and completions.jsonl keeps the whole
    generation with each reward function's value for its text."""
    from fusedalign.cli import main
    from fusedalign.cli.demo import DEMO_TRAINING
    from fusedalign.rewards import BUILTIN_REWARDS

    out = tmp_path / "grpo"
    assert main(["grpo", "--log_completions", "--num_completions_to_print", "2", "--max_steps", "1",
                 "--reward_funcs", "zen_words", "vowels", "--output_dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    demo = DEMO_TRAINING["grpo"]
    assert len(rows) == demo["per_device_train_batch_size"] and {r["step"] for r in rows} == {1}  # one generation
    for row in rows:  # (the rewards travel in float32)
        assert set(row["rewards"]) == {"zen_words", "vowels"}
        for name, value in row["rewards"].items():
            assert value == pytest.approx(BUILTIN_REWARDS[name]()([row["completion"]])[0], rel=1e-6, abs=1e-7)
    tables = _printed_tables(capsys.readouterr().out)
    assert len(tables) == 1 and tables[0][0] == ["step", "prompt", "completion", "zen_words", "vowels", "advantage"]
    assert len(tables[0]) == 1 + 2 and [r[-1] for r in tables[0][1:]] == [f"{r['advantage']:.4g}" for r in rows[:2]]


def _batch(**parts) -> GRPOMicroBatch:
    labels = torch.tensor([[-100, 5, 6], [-100, 7, -100]])
    return GRPOMicroBatch(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3),
                          labels=labels, advantages=torch.zeros(2), **parts)


def test_the_micro_batch_refuses_a_missing_part_and_one_it_must_not_use():
    with pytest.raises(MissingPartError, match="no old_logps"):
        _batch().require(old_logps=True, ref_logps=False, entropy_weight=False)
    with pytest.raises(MissingPartError, match="no ref_logps"):
        _batch(old_logps=torch.zeros(2, 3)).require(old_logps=True, ref_logps=True, entropy_weight=False)
    with pytest.raises(MissingPartError, match="has entropy_weight"):
        _batch(entropy_weight=torch.tensor(0.5)).require(old_logps=False, ref_logps=False, entropy_weight=False)
    with pytest.raises(ValueError, match="old_logps has shape"):
        _batch(old_logps=torch.zeros(2, 4))
    ok = _batch(old_logps=torch.zeros(2, 3), ref_logps=torch.zeros(2, 3))
    assert ok.require(old_logps=True, ref_logps=True, entropy_weight=False) is ok


def test_the_trainer_refuses_a_batch_without_the_old_policy_log_probs(tmp_path):
    """num_iterations 2 needs the generating policy's log-probs: a batch without them is refused,
    never trained with ratio 1."""
    trainer, _, _ = _train(tmp_path, max_steps=1, save_strategy="no")
    batch = trainer.rollout.window.batches[0].replace(old_logps=None)
    with pytest.raises(MissingPartError, match="no old_logps"):
        trainer.loss_and_metrics(trainer.model, batch, "train")


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_python_api_resume_keeps_the_completions_log_as_the_uninterrupted_run(tmp_path):
    """From Python, not the command line: resuming checkpoint-2 of a finished 4-step run in its own
    directory cuts completions.jsonl back to step 2 before training on, so it ends as the
    uninterrupted run's (the rows of step 3 appear once); a new run there moves the old log aside."""
    logged = dict(log_completions=True, num_completions_to_print=0)
    _train(tmp_path / "straight", **logged)
    want = _rows(tmp_path / "straight" / "completions.jsonl")
    assert sorted({r["step"] for r in want}) == [1, 3] and len(want) == 8  # 4 completions a window
    out = tmp_path / "run"
    _train(out, **logged)
    _train(out, resume=str(out / "checkpoint-2"), **logged)
    assert _rows(out / "completions.jsonl") == want
    _train(out, max_steps=2, **logged)  # a new run in the same directory
    assert _rows(out / "completions.previous-1.jsonl") == want
    assert _rows(out / "completions.jsonl") == [r for r in want if r["step"] == 1]
