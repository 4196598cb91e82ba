"""fused_divergence in real (tiny) models: the student's and the teacher's heads, fused equals unfused."""

from __future__ import annotations

import pytest
import torch

from fusedalign.distill_head import fused_divergence, token_divergence
from fusedalign.losses.distillation import distillation_batch_loss, distillation_loss
from fusedalign.models import load_model
from tests.unit.test_divergence import trl_jsd
from tests.unit.test_head import _batch, _model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _both(student, teacher, inputs, labels, **kw):
    """(divergence, entropy, student gradients) fused and unfused, from the same upstream gradient."""
    results = []
    for fused in (True, False):
        student.zero_grad()
        out = token_divergence(student, teacher, inputs, labels, fused=fused, **kw)
        upstream = torch.linspace(0.5, 1.5, out.divergence.numel(), dtype=out.divergence.dtype)
        (out.divergence * upstream.view_as(out.divergence)).sum().backward()
        results.append((out.divergence.detach(), out.entropy, _grads(student)))
    return results


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_softcapped_teacher_of_another_architecture(beta, temperature):
    student = _model("builtin:tiny-qwen2")
    teacher = _model("builtin:tiny-gemma2", head_scale=400.0)  # logits reach Gemma 2's cap of 30
    inputs, labels = _batch(student)
    with torch.no_grad():
        raw = teacher(**inputs).logits
    assert raw.abs().max() > 15  # the soft-cap is not the identity here: the test can see it
    (fused, fused_entropy, fused_grads), (ref, ref_entropy, ref_grads) = _both(
        student, teacher, inputs, labels, beta=beta, temperature=temperature)
    torch.testing.assert_close(fused, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fused_entropy, ref_entropy, rtol=1e-10, atol=1e-12)
    assert set(fused_grads) == set(ref_grads) and "lm_head.weight" in fused_grads
    for name, value in ref_grads.items():
        torch.testing.assert_close(fused_grads[name], value, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    # The unfused oracle is TRL's formula on the models' own logits.
    with torch.no_grad():
        want = trl_jsd(student(**inputs).logits, raw, beta, temperature)
    scored = labels != -100
    torch.testing.assert_close(fused[scored], want[scored], rtol=1e-10, atol=1e-12)
    assert (fused[~scored] == 0).all() and (fused[scored] > 0).all()
    assert all(p.grad is None for p in teacher.parameters())  # the teacher gets nothing
    # Both heads' forwards and Gemma's soft-cap are back.
    assert "forward" not in teacher.lm_head.__dict__ and "forward" not in student.lm_head.__dict__
    assert teacher.config.final_logit_softcapping == 30.0


def test_lora_on_the_student_head_reaches_the_adapter():
    from peft import LoraConfig, get_peft_model

    student = get_peft_model(_model("builtin:tiny-qwen2"), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    teacher = _model("builtin:tiny-llama")
    inputs, labels = _batch(student)
    (fused, _, fused_grads), (ref, _, ref_grads) = _both(student, teacher, inputs, labels, beta=0.5)
    torch.testing.assert_close(fused, ref, rtol=1e-10, atol=1e-12)
    head_lora = [n for n in ref_grads if "lm_head" in n and "lora_" in n]
    assert len(head_lora) == 2 and set(fused_grads) == set(ref_grads)
    for name, value in ref_grads.items():
        torch.testing.assert_close(fused_grads[name], value, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_teacher_with_padded_vocabulary_rows():
    student = _model("builtin:tiny-qwen2")
    teacher = _model("builtin:tiny-llama")
    teacher.resize_token_embeddings(520)  # 8 padded rows, as a larger checkpoint of one tokenizer has
    inputs, labels = _batch(student)
    (fused, _, fused_grads), (ref, _, ref_grads) = _both(student, teacher, inputs, labels, beta=0.5)
    torch.testing.assert_close(fused, ref, rtol=1e-10, atol=1e-12)
    for name, value in ref_grads.items():
        torch.testing.assert_close(fused_grads[name], value, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="beta=0"):
        token_divergence(student, teacher, inputs, labels, beta=0.0)


def test_chunked_over_the_vocabulary_in_the_models():
    student, teacher = _model("builtin:tiny-qwen2"), _model("builtin:tiny-gemma2", head_scale=50.0)
    inputs, labels = _batch(student)
    whole = token_divergence(student, teacher, inputs, labels, beta=0.3)
    blocks = token_divergence(student, teacher, inputs, labels, beta=0.3, chunk_size=5, vocab_chunk_size=100)
    torch.testing.assert_close(whole.divergence, blocks.divergence, rtol=1e-12, atol=1e-14)


def test_student_before_teacher_is_an_error():
    student, teacher = _model("builtin:tiny-qwen2"), _model("builtin:tiny-llama")
    inputs, labels = _batch(student)
    with pytest.raises(RuntimeError, match="before the teacher's forward"):
        with fused_divergence(student, teacher, labels):
            student(**inputs)


def test_loss_sums_over_a_global_token_count():
    g = torch.Generator().manual_seed(0)
    d = torch.rand(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    entropy = torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[3] = False
    whole = distillation_loss(d, mask, mask.sum())
    assert torch.isclose(whole, d[mask].sum() / mask.sum())
    # Micro-batches of a step, each summed, divided by the step's count, train as the whole batch.
    parts = sum(distillation_batch_loss(d[i:i + 2], mask[i:i + 2], entropy[i:i + 2])[0] for i in (0, 2))
    assert torch.isclose(parts / mask.sum(), whole)
    _, metrics = distillation_batch_loss(d, mask, entropy)
    assert torch.isclose(metrics.entropy.sum.sum() / metrics.entropy.count.sum(), entropy[mask].mean())
    empty = distillation_loss(d, torch.zeros_like(mask), 0)
    assert empty == 0 and empty.requires_grad  # nothing to score: still connected
