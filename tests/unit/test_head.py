"""fused_head installed in real (tiny) models: same log-probs and gradients as the unfused path."""

from __future__ import annotations

import pytest
import torch

from fusedalign.head import (
    UnsupportedArchitectureError,
    fused_head,
    logprobs_from_logits,
    token_logprobs,
)
from fusedalign.models import load_model

FAMILIES = ["builtin:tiny-qwen2", "builtin:tiny-llama", "builtin:tiny-gemma2"]


def _batch(model, batch=3, seq=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, -3:] = 0  # a right-padded row
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[0, :4] = -100  # an unscored prompt
    labels[1, -4:] = -100
    return {"input_ids": ids, "attention_mask": mask}, labels


def _model(name, dtype=torch.float64, head_scale=1.0):
    torch.manual_seed(0)
    model = load_model(name, dtype=dtype)
    if head_scale != 1.0:
        # Random init gives logits near 0, where a soft-cap is the identity; scale the
        # head so the logits reach the cap and the test can see whether it is applied.
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(head_scale)
    return model


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, inputs, labels, fused, upstream):
    model.zero_grad(set_to_none=True)
    out = token_logprobs(model, inputs, targets=labels, fused=fused, entropy=True, logit_mean=True, argmax=True,
                         log_sum_sq_probs=True)
    (out.logps * upstream).sum().backward()
    return out, _grads(model)


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_equals_unfused_values_stats_and_every_gradient(name):
    model = _model(name, head_scale=400.0 if "gemma2" in name else 1.0)
    inputs, labels = _batch(model)
    upstream = torch.randn(labels.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = _run(model, inputs, labels, False, upstream)
    got, got_grads = _run(model, inputs, labels, True, upstream)
    torch.testing.assert_close(got.logps, ref.logps, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.logit_mean, ref.logit_mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.log_sum_sq_probs, ref.log_sum_sq_probs, rtol=1e-9, atol=1e-9)
    assert (got.log_sum_sq_probs[labels == -100] == 0).all() and (got.log_sum_sq_probs[labels != -100] < 0).all()
    assert torch.equal(got.argmax_match, ref.argmax_match)
    assert (got.logps[labels == -100] == 0).all() and (got.logps <= 0).all()
    assert set(got_grads) == set(ref_grads) and len(ref_grads) == len(list(model.parameters()))
    for param_name, grad in ref_grads.items():
        torch.testing.assert_close(got_grads[param_name], grad, rtol=1e-8, atol=1e-10, msg=param_name)


def test_softcap_moves_into_the_op_and_matters():
    model = _model("builtin:tiny-gemma2", head_scale=400.0)
    inputs, labels = _batch(model)
    logits = model(**inputs).logits
    assert logits.abs().max() <= 30.0 and logits.abs().max() > 25.0  # the cap is active
    with torch.no_grad():
        fused = token_logprobs(model, inputs, targets=labels, fused=True).logps
        cap = model.config.final_logit_softcapping
        model.config.final_logit_softcapping = None
        uncapped = logprobs_from_logits(model(**inputs).logits, labels).logps
        model.config.final_logit_softcapping = cap
    assert not torch.allclose(fused, uncapped, atol=1e-3)  # the test would see a missing cap
    assert model.config.final_logit_softcapping == 30.0


@pytest.mark.parametrize("name", FAMILIES)
def test_model_returns_normal_logits_after_the_context(name):
    model = _model(name)
    inputs, labels = _batch(model)
    before = model(**inputs).logits
    with fused_head(model, labels):
        inside = model(**inputs).logits
    after = model(**inputs).logits
    assert inside.shape == labels.shape and before.shape == (*labels.shape, model.config.vocab_size)
    torch.testing.assert_close(after, before)
    assert "forward" not in model.get_output_embeddings().__dict__


def test_restored_on_exception_and_nesting_is_an_error():
    model = _model("builtin:tiny-gemma2")
    inputs, labels = _batch(model)
    with pytest.raises(RuntimeError, match="nested"):
        with fused_head(model, labels):
            with fused_head(model, labels):
                pass
    with pytest.raises(KeyError):
        with fused_head(model, labels):
            raise KeyError("boom")
    assert "forward" not in model.get_output_embeddings().__dict__
    assert model.config.final_logit_softcapping == 30.0
    assert model(**inputs).logits.dim() == 3


def test_logits_to_keep_scores_the_kept_positions():
    model = _model("builtin:tiny-qwen2")
    inputs, labels = _batch(model)
    full = logprobs_from_logits(model(**inputs).logits, labels).logps
    with fused_head(model, labels):
        kept = model(**inputs, logits_to_keep=4).logits
    torch.testing.assert_close(kept, full[:, -4:], rtol=1e-9, atol=1e-9)


def test_unknown_architecture_is_refused_with_the_way_out():
    model = _model("builtin:tiny-qwen2")
    inputs, labels = _batch(model)
    model.config.model_type = "mystery"
    with pytest.raises(UnsupportedArchitectureError, match=r"mystery.*fused_head=False"):
        token_logprobs(model, inputs, targets=labels, fused=True)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
@pytest.mark.parametrize("name", ["builtin:tiny-qwen2", "builtin:tiny-llama"])
def test_lora_fused_equals_unfused_and_trains_the_adapter(name, targets):
    from peft import LoraConfig, get_peft_model

    model = _model(name)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(model, config)
    inputs, labels = _batch(model)
    upstream = torch.randn(labels.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref, ref_grads = _run(model, inputs, labels, False, upstream)
    got, got_grads = _run(model, inputs, labels, True, upstream)
    torch.testing.assert_close(got.logps, ref.logps, rtol=1e-9, atol=1e-9)
    lora_grads = [n for n in ref_grads if "lora_" in n]
    assert lora_grads and set(got_grads) == set(ref_grads)
    if "lm_head" in targets:
        assert any("lm_head" in n for n in lora_grads)
    for param_name in lora_grads:
        assert got_grads[param_name].abs().sum() > 0, param_name
        torch.testing.assert_close(got_grads[param_name], ref_grads[param_name], rtol=1e-8, atol=1e-10)
    # The reference mode "policy with its adapter disabled" goes through the same path.
    with model.disable_adapter(), torch.no_grad():
        base_fused = token_logprobs(model, inputs, targets=labels, fused=True).logps
        base_unfused = token_logprobs(model, inputs, targets=labels, fused=False).logps
    torch.testing.assert_close(base_fused, base_unfused, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(base_fused, got.logps)  # the adapter really was off


def test_lora_dropout_on_the_head_matches_unfused_with_the_same_mask():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _model("builtin:tiny-qwen2"),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["lm_head"], init_lora_weights=False),
    )
    model.train()
    inputs, labels = _batch(model)
    torch.manual_seed(5)
    ref = token_logprobs(model, inputs, targets=labels, fused=False).logps
    torch.manual_seed(5)
    got = token_logprobs(model, inputs, targets=labels, fused=True).logps
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


def _run_entropy_grad(model, inputs, labels, fused, upstream):
    """Values and every parameter's gradient of sum g logp + sum g^H H (GRPO's entropy bonus)."""
    model.zero_grad(set_to_none=True)
    out = token_logprobs(model, inputs, targets=labels, fused=fused, entropy_grad=True)
    assert out.entropy.requires_grad
    ((out.logps * upstream[0]).sum() + (out.entropy * upstream[1]).sum()).backward()
    return out, _grads(model)


@pytest.mark.parametrize("name, lora", [("builtin:tiny-qwen2", False), ("builtin:tiny-gemma2", False),
                                        ("builtin:tiny-qwen2", True)], ids=["qwen2", "gemma2_softcap", "qwen2_lora_head"])
def test_entropy_grad_fused_equals_unfused_values_and_every_gradient(name, lora):
    model = _model(name, head_scale=400.0 if "gemma2" in name else 1.0)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "lm_head"],
                                                 init_lora_weights=False))
    inputs, labels = _batch(model)
    gen = torch.Generator().manual_seed(3)
    upstream = [torch.randn(labels.shape, dtype=torch.float64, generator=gen) for _ in range(2)]
    ref, ref_grads = _run_entropy_grad(model, inputs, labels, False, upstream)
    got, got_grads = _run_entropy_grad(model, inputs, labels, True, upstream)
    torch.testing.assert_close(got.logps, ref.logps, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=1e-9, atol=1e-9)
    assert (got.entropy[labels == -100] == 0).all() and (got.entropy[labels != -100] > 0).all()
    assert set(got_grads) == set(ref_grads) and ref_grads
    if lora:
        assert any("lm_head" in n and "lora_" in n for n in got_grads)
    for param_name, grad in ref_grads.items():
        torch.testing.assert_close(got_grads[param_name], grad, rtol=1e-8, atol=1e-10, msg=param_name)
    # The entropy's term is really in those gradients: without it they differ.
    model.zero_grad(set_to_none=True)
    plain = token_logprobs(model, inputs, targets=labels, fused=True)
    (plain.logps * upstream[0]).sum().backward()
    head_grad = next(n for n in ref_grads if "lm_head" in n or "embed_tokens" in n)
    assert not torch.allclose(_grads(model)[head_grad], ref_grads[head_grad])


def test_entropy_grad_through_fused_head_directly_returns_both_stacked():
    model = _model("builtin:tiny-qwen2")
    inputs, labels = _batch(model)
    with fused_head(model, labels, entropy_grad=True) as head:
        stacked = model(**inputs).logits
    assert stacked.shape == (*labels.shape, 2)
    torch.testing.assert_close(stacked[..., 0], head.last.logps, rtol=0, atol=0)
    torch.testing.assert_close(stacked[..., 1], head.last.entropy, rtol=0, atol=0)


def test_batch_invariant_reaches_the_op_and_keeps_the_function(monkeypatch):
    import fusedalign.head_forward as head_module

    seen = []
    op = head_module.head_logprobs
    monkeypatch.setattr(head_module, "head_logprobs", lambda *a, **kw: seen.append(kw["batch_invariant"]) or op(*a, **kw))
    model = _model("builtin:tiny-gemma2", head_scale=400.0)
    inputs, labels = _batch(model)
    with torch.no_grad():
        got = token_logprobs(model, inputs, targets=labels, fused=True, batch_invariant=True, entropy=True)
        ref = token_logprobs(model, inputs, targets=labels, fused=False, batch_invariant=True, entropy=True)
    assert seen == [True]
    torch.testing.assert_close(got.logps, ref.logps, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("fused", [True, False])
def test_labels_take_transformers_convention(fused):
    """labels=input_ids (what an HF user passes) scores every next token: minus the mean of
    the log-probs is transformers' own causal-LM loss for the same labels."""
    model = _model("builtin:tiny-qwen2")
    inputs, _ = _batch(model)
    hf_labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)  # [B, T]
    hf_labels[0, :4] = -100
    out = token_logprobs(model, inputs, labels=hf_labels, fused=fused)
    scored = torch.cat([hf_labels[:, 1:] != -100, torch.zeros_like(hf_labels[:, :1], dtype=torch.bool)], 1)
    hf_loss = model(**inputs, labels=hf_labels).loss
    torch.testing.assert_close(-out.logps[scored].double().mean(), hf_loss.double(), rtol=1e-6, atol=1e-6)
    assert (out.logps[~scored] == 0).all()
    assert out.backend == ("torch-chunked" if fused else "unfused")


def test_labels_and_targets_are_keyword_only_and_exclusive():
    model = _model("builtin:tiny-qwen2")
    inputs, targets = _batch(model)
    with pytest.raises(TypeError):
        token_logprobs(model, inputs, targets)  # positional: the convention would be a guess
    with pytest.raises(TypeError, match="exactly one of labels="):
        token_logprobs(model, inputs, labels=inputs["input_ids"], targets=targets)
    with pytest.raises(TypeError, match="exactly one of labels="):
        token_logprobs(model, inputs)
