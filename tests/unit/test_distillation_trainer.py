"""DistillationTrainer on tiny models (student tiny-qwen2, teacher tiny-zen-teacher: another
architecture, tied head) with replayed completions: the first step's loss, entropy and update
are TRL's generalised JSD computed by hand from full logits, fused = unfused for beta 0, 0.5
and 1 and with LoRA on the student's head, tiled MLPs (student and teacher) train as whole ones,
a step is the same however it is split, a teacher
with a larger (padded) head trains and one with beta 0 is refused, and a run resumed from a
checkpoint (keyed sampling) equals the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from fusedalign.configs import DistillationConfig
from fusedalign.data import load_dataset_any
from fusedalign.models import load_model, load_tokenizer
from fusedalign.trainers.distillation import DistillationTrainer
from tests.grpo_replay import uneven_replay

MODEL, TEACHER = "builtin:tiny-qwen2", "builtin:tiny-zen-teacher"
ROWS, T = 16, 0.9


@pytest.fixture(scope="module")
def prompts() -> Dataset:
    return load_dataset_any("builtin:zen", "standard_prompt_only").select(range(ROWS))


@pytest.fixture(scope="module")
def replay():
    return uneven_replay(ROWS, 1, load_tokenizer(MODEL).eos_token_id)


def _args(tmp_path, **overrides) -> DistillationConfig:
    values = dict(
        output_dir=str(tmp_path), max_steps=2, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_completion_length=12, temperature=T, logging_steps=1, save_strategy="no",
        seed=0, report_to="none", disable_tqdm=True, shuffle_dataset=False,
    )
    values.update(overrides)
    return DistillationConfig(**values)


def _train(tmp_path, prompts, generator=None, teacher=TEACHER, peft_config=None, resume=None, **overrides):
    torch.manual_seed(0)
    trainer = DistillationTrainer(load_model(MODEL), teacher, args=_args(tmp_path, **overrides), train_dataset=prompts,
                                  generator=generator, peft_config=peft_config)
    trainer.train(resume_from_checkpoint=resume)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return trainer, logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _hand_divergence(zs: torch.Tensor, zt: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL 1.16's generalised JSD per token, written out: p student, q teacher, both at temperature T."""
    ls, lt = torch.log_softmax(zs.double() / T, -1), torch.log_softmax(zt.double() / T, -1)
    p, q = ls.exp(), lt.exp()
    if beta == 0.0:
        return (q * (lt - ls)).sum(-1)
    if beta == 1.0:
        return (p * (ls - lt)).sum(-1)
    lm = torch.log((1 - beta) * p + beta * q)
    return beta * (q * (lt - lm)).sum(-1) + (1 - beta) * (p * (ls - lm)).sum(-1)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_first_step_is_trls_divergence_by_hand(tmp_path, prompts, replay, beta):
    """Loss = sum of D over the step's completion tokens / their count; entropy its token mean; the
    SGD update is -lr x the gradient of that hand-computed loss."""
    trainer, logs, weights = _train(tmp_path, prompts, replay, beta=beta, max_steps=1)
    teacher = load_model(TEACHER)
    torch.manual_seed(0)
    student = load_model(MODEL)
    initial = {k: v.detach().clone() for k, v in student.state_dict().items()}
    divergences, entropies = [], []
    for row in range(8):  # the step's generation batch: rows 0-7 (no shuffle), one completion each
        prompt, completion = list(trainer.train_dataset[row]["prompt_ids"]), replay.records[(row, 0)][0]
        ids = torch.tensor([prompt + completion])
        scored = slice(len(prompt) - 1, ids.shape[1] - 1)
        zs = student(input_ids=ids).logits[0, scored]
        with torch.no_grad():
            zt = teacher(input_ids=ids).logits[0, scored]
        divergences.append(_hand_divergence(zs, zt, beta))
        p = torch.softmax(zs.detach().double() / T, -1)
        entropies.append(-(p * p.log()).sum(-1))
    loss = torch.cat(divergences).mean()
    loss.backward()
    assert logs[0]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert logs[0]["entropy"] == pytest.approx(torch.cat(entropies).mean().item(), rel=1e-6)
    for name, param in student.named_parameters():
        expected = initial[name] - 0.5 * param.grad
        torch.testing.assert_close(weights[name], expected.float(), rtol=1e-4, atol=1e-6, msg=name)
    assert any(not torch.equal(weights[n], initial[n]) for n in initial)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_equals_unfused(tmp_path, prompts, replay, beta):
    _, fused, wf = _train(tmp_path / "f", prompts, replay, beta=beta)
    _, unfused, wu = _train(tmp_path / "u", prompts, replay, beta=beta, fused_head=False)
    for key in ("loss", "entropy", "grad_norm"):
        assert [r[key] for r in fused] == pytest.approx([r[key] for r in unfused], rel=1e-5), key
    for name in wf:
        torch.testing.assert_close(wf[name], wu[name], rtol=1e-5, atol=1e-6, msg=name)


def test_tiled_mlps_in_student_and_teacher_train_as_whole_ones(tmp_path, prompts, replay):
    """--tiled_mlp_tokens 5: the student's and the teacher's MLPs over tiles (completions of up to 12
    tokens after their prompts), the same losses and weights as whole MLPs."""
    tiled_trainer, tiled, wt = _train(tmp_path / "t", prompts, replay, tiled_mlp_tokens=5)
    _, whole, ww = _train(tmp_path / "w", prompts, replay)
    for model in (tiled_trainer.model, tiled_trainer.teacher_model):
        mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
        assert mlps and all(m._fusedalign_tile_tokens == 5 for m in mlps), type(model).__name__
    for key in ("loss", "entropy", "grad_norm"):
        assert [r[key] for r in tiled] == pytest.approx([r[key] for r in whole], rel=1e-5), key
    for name in ww:
        torch.testing.assert_close(wt[name], ww[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fused_equals_unfused_with_lora_on_the_students_head(tmp_path, prompts, replay):
    from peft import LoraConfig

    def lora():
        return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                          target_modules=["q_proj", "v_proj", "lm_head"])

    trainer, fused, wf = _train(tmp_path / "f", prompts, replay, beta=0.5, peft_config=lora())
    _, unfused, wu = _train(tmp_path / "u", prompts, replay, beta=0.5, peft_config=lora(), fused_head=False)
    assert [r["loss"] for r in fused] == pytest.approx([r["loss"] for r in unfused], rel=1e-5)
    head = [n for n in wf if "lm_head" in n and "lora_B" in n]
    assert head and any(wf[n].abs().sum() > 0 for n in head)  # the head's adapter learned (B starts at 0)
    for name in wf:
        torch.testing.assert_close(wf[name], wu[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_step_is_the_same_however_it_is_split(tmp_path, prompts, replay):
    """8 prompts a step as 1 x 8 or 4 micro-batches of 2: the same losses and weights (global token normaliser)."""
    _, whole, ww = _train(tmp_path / "w", prompts, replay, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    _, split, ws = _train(tmp_path / "s", prompts, replay, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    assert [r["loss"] for r in whole] == pytest.approx([r["loss"] for r in split], rel=1e-5)
    for name in ww:
        torch.testing.assert_close(ww[name], ws[name], rtol=1e-5, atol=1e-6, msg=name)


def _padded_teacher(rows: int):
    """The zen teacher with its vocabulary padded to `rows` (new rows never predicted in training data)."""
    teacher = load_model(TEACHER)
    teacher.resize_token_embeddings(rows, mean_resizing=False)
    with torch.no_grad():
        teacher.get_output_embeddings().weight[512:].normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    return teacher


def test_a_teacher_with_a_larger_padded_head_trains_fused_as_unfused(tmp_path, prompts, replay):
    _, fused, wf = _train(tmp_path / "f", prompts, replay, teacher=_padded_teacher(576), beta=0.5)
    _, unfused, wu = _train(tmp_path / "u", prompts, replay, teacher=_padded_teacher(576), beta=0.5, fused_head=False)
    assert [r["loss"] for r in fused] == pytest.approx([r["loss"] for r in unfused], rel=1e-5)
    for name in wf:
        torch.testing.assert_close(wf[name], wu[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_larger_teacher_head_with_forward_kl_and_a_smaller_one_are_refused(tmp_path, prompts):
    with pytest.raises(ValueError, match=r"larger than the student's \(512\) and beta is 0"):
        DistillationTrainer(load_model(MODEL), _padded_teacher(576), args=_args(tmp_path, beta=0.0),
                            train_dataset=prompts)
    small = load_model(TEACHER)
    small.resize_token_embeddings(504, mean_resizing=False)
    with pytest.raises(ValueError, match=r"smaller than the student's"):
        DistillationTrainer(load_model(MODEL), small, args=_args(tmp_path), train_dataset=prompts)


def test_resumed_from_a_checkpoint_equals_uninterrupted(tmp_path, prompts):
    """Keyed sampling: completions depend on (seed, generation, row), and the generation counter is
    in the checkpoint, so steps 3-4 after a resume from checkpoint-2 are the uninterrupted run's."""
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, keyed_sampling=True, max_completion_length=6,
                  learning_rate=0.05)
    _, full, wfull = _train(tmp_path / "a", prompts, **common)
    _, resumed, wres = _train(tmp_path / "b", prompts, resume=str(tmp_path / "a" / "checkpoint-2"), **common)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # steps 1-2 from the checkpoint's state
    resumed = resumed[2:]
    for key in ("loss", "entropy", "completions/mean_length"):
        assert [r[key] for r in resumed] == pytest.approx([r[key] for r in full[2:]], rel=1e-6), key
    for name in wfull:
        torch.testing.assert_close(wres[name], wfull[name], rtol=1e-6, atol=1e-7, msg=name)


def test_evaluation_on_conversational_prompts_fused_equals_unfused(tmp_path):
    """Conversational prompts (the chat template applied), 14 rows in batches of 5 (the last one
    short): both paths give the same eval loss, entropy and completion lengths."""
    train = load_dataset_any("builtin:zen", "conversational_prompt_only", split="train").select(range(8))
    evaluate = load_dataset_any("builtin:zen", "conversational_prompt_only", split="test")
    got = {}
    for fused in (True, False):
        trainer = DistillationTrainer(load_model(MODEL), TEACHER, train_dataset=train, eval_dataset=evaluate,
                                      args=_args(tmp_path, keyed_sampling=True, per_device_eval_batch_size=5,
                                                 fused_head=fused, beta=0.3, max_completion_length=6))
        got[fused] = trainer.evaluate()
    assert got[True]["eval_loss"] > 0
    for key in ("eval_loss", "eval_entropy", "eval_completions/mean_length"):
        assert got[True][key] == pytest.approx(got[False][key], rel=1e-5), key
