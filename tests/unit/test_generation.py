"""Generators: KeyedSampler's draws (batch invariance, exact distribution), HFGenerate, Replay."""

from __future__ import annotations

import pytest
import torch

from fusedalign.generation import (
    GenerationError,
    HFGenerate,
    KeyedSampler,
    Recorder,
    Replay,
    cut_after_eos,
    filter_logits,
    left_pad,
)
from fusedalign.models import load_model, load_tokenizer


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("builtin:tiny-qwen2").eval(), load_tokenizer("builtin:tiny-qwen2")


def _prompts(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


# ------------------------------------------------------------------ KeyedSampler


def test_draws_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 40, generator=g)
    keys = [(7, 0), (7, 1), (3, 0), (12, 5), (0, 0)]
    s = KeyedSampler(seed=1, temperature=0.8, top_k=20, top_p=0.9)
    for position in (0, 1, 9):
        s.bind(keys, prompt_length=4, step=2)
        together, _ = s.draw(scores, position)
        for order in ([3], [4, 0], [2, 3, 1]):
            s.bind([keys[i] for i in order], prompt_length=11, step=2)  # other batch-mates, other padding
            alone, _ = s.draw(scores[order], position)
            assert alone.tolist() == together[order].tolist()
    # Every part of the key matters.
    s.bind(keys, 4, step=2)
    base = torch.stack([s.draw(scores, p)[0] for p in range(30)])
    for other in (KeyedSampler(seed=2, temperature=0.8, top_k=20, top_p=0.9),):
        other.bind(keys, 4, step=2)
        assert not torch.equal(torch.stack([other.draw(scores, p)[0] for p in range(30)]), base)
    s.bind(keys, 4, step=3)
    assert not torch.equal(torch.stack([s.draw(scores, p)[0] for p in range(30)]), base)


def _empirical(sampler: KeyedSampler, z: torch.Tensor, n: int) -> torch.Tensor:
    counts = torch.zeros(z.numel(), dtype=torch.float64)
    rows = 2000
    for start in range(0, n, rows):
        sampler.bind([(start + i, 3) for i in range(rows)], prompt_length=0, step=0)
        tokens, _ = sampler.draw(z.expand(rows, -1), position=5)
        counts += torch.bincount(tokens, minlength=z.numel()).double()
    return counts / counts.sum()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7)])
def test_draws_are_samples_of_the_tempered_softmax(top_k, top_p):
    z = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    T = 0.7
    want = filter_logits(z.double() / T, top_k, top_p).softmax(-1)[0]
    if top_k or top_p < 1:
        assert (want == 0).any()  # the filter removes something
    got = _empirical(KeyedSampler(seed=0, temperature=T, top_k=top_k, top_p=top_p), z, 40_000)
    tv = 0.5 * (got - want).abs().sum()
    assert tv < 0.015, (got, want)
    assert (got[want == 0] == 0).all()  # filtered tokens are never drawn


def test_filter_matches_transformers_warpers():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    z = torch.randn(4, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ids = torch.zeros(4, 1, dtype=torch.long)
    want = MinPLogitsWarper(0.05)(ids, TopPLogitsWarper(0.8)(ids, TopKLogitsWarper(20)(ids, z.clone())))
    got = filter_logits(z, 20, 0.8, 0.05)
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1))


def test_sampler_log_probs_are_those_of_the_filtered_softmax():
    z = torch.randn(3, 30, generator=torch.Generator().manual_seed(4))
    s = KeyedSampler(seed=5, temperature=1.3, top_k=10)
    s.bind([(0, 0), (1, 0), (2, 0)], 0)
    tokens, logps = s.draw(z, 0)
    want = filter_logits(z.double() / 1.3, 10).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logps, want)


def test_keyed_generation_is_the_same_alone_and_padded_in_a_batch(tiny):
    model, tok = tiny
    gen = HFGenerate(max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     sampler=KeyedSampler(seed=11, temperature=1.0))
    prompts = _prompts(tok, ["Beautiful is", "Flat is better than nested. Sparse", "Now"])
    keys = [(0, 0), (1, 2), (2, 1)]
    together = gen.generate(model, prompts, keys, step=4)
    for i in range(3):
        alone = gen.generate(model, [prompts[i]], [keys[i]], step=4)
        assert alone.completion_ids[0] == together.completion_ids[i]
        torch.testing.assert_close(torch.tensor(alone.logprobs[0]), torch.tensor(together.logprobs[i]), atol=1e-5, rtol=0)
    other_step = gen.generate(model, prompts, keys, step=5)
    assert other_step.completion_ids != together.completion_ids


# ------------------------------------------------------------------ HFGenerate


def test_cut_after_eos_and_truncation():
    tokens = torch.tensor([[5, 6, 2, 7, 2], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0], [5, 9, 9, 9, 3]])
    ids, truncated = cut_after_eos(tokens, [2, 3])
    assert ids == [[5, 6, 2], [5, 6, 7, 8, 9], [2], [5, 9, 9, 9, 3]]
    assert truncated == [False, True, False, False]


def test_left_pad():
    ids, mask = left_pad([[4, 5, 6], [7]], pad_token_id=0)
    assert ids.tolist() == [[4, 5, 6], [0, 0, 7]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(GenerationError, match="at least one token"):
        left_pad([[1], []], 0)


def test_hf_generate_cuts_after_the_first_eos(tiny):
    model, tok = tiny
    prompts = _prompts(tok, ["Beautiful is", "Flat is better than nested."])
    greedy = HFGenerate(max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False)
    free = greedy.generate(model, prompts, [(0, 0), (1, 0)])
    assert free.truncated == [True, True] and [len(c) for c in free.completion_ids] == [8, 8]
    stop = free.completion_ids[0][2]  # make the third token of row 0 an end of sequence
    assert stop not in free.completion_ids[1] and stop not in free.completion_ids[0][:2]
    ended = HFGenerate(max_new_tokens=8, eos_token_id=[tok.eos_token_id, stop], pad_token_id=tok.pad_token_id,
                       do_sample=False).generate(model, prompts, [(0, 0), (1, 0)])
    assert ended.completion_ids[0] == free.completion_ids[0][:3]  # up to and including the EOS
    assert ended.truncated == [False, True]
    assert ended.completion_ids[1] == free.completion_ids[1]


def test_static_cache_decodes_like_the_dynamic_cache(tiny):
    model, tok = tiny
    prompts = _prompts(tok, ["Beautiful is", "Errors should never"])
    kw = dict(max_new_tokens=6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False)
    dynamic = HFGenerate(**kw).generate(model, prompts, [(0, 0), (1, 0)])
    static = HFGenerate(**kw, cache_implementation="static").generate(model, prompts, [(0, 0), (1, 0)])
    assert static.completion_ids == dynamic.completion_ids


def test_trl_sampling_defaults_from_the_config():
    from fusedalign.configs.grpo import GRPOConfig

    tok = load_tokenizer("builtin:tiny-qwen2")
    args = GRPOConfig(output_dir="/tmp/unused", per_device_train_batch_size=8, report_to="none")
    fields = HFGenerate.from_args(args, tok).config_fields
    assert fields["max_new_tokens"] == 512 and fields["do_sample"] is True
    assert (fields["temperature"], fields["top_p"], fields["top_k"], fields["min_p"], fields["repetition_penalty"]) == (
        1.0, 1.0, 0, None, 1.0)
    assert fields["disable_compile"] is True and fields["cache_implementation"] is None
    compiled = HFGenerate(max_new_tokens=4, eos_token_id=0, pad_token_id=0, compile_decoding=True).config_fields
    assert compiled["cache_implementation"] == "static" and compiled["disable_compile"] is False


# ------------------------------------------------------------------ Replay


def test_replay_round_trip(tiny, tmp_path):
    model, tok = tiny
    prompts = _prompts(tok, ["Beautiful is", "Flat", "Now is"])
    keys = [(4, 0), (4, 1), (9, 0)]
    recorder = Recorder(HFGenerate(max_new_tokens=5, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   sampler=KeyedSampler(seed=3)))
    first = recorder.generate(model, prompts, keys)
    recorder.replay().save(tmp_path / "c.jsonl")
    replay = Replay.load(tmp_path / "c.jsonl")
    again = replay.generate(None, prompts[::-1], keys[::-1])  # any order, no model needed
    assert again.completion_ids == first.completion_ids[::-1]
    assert again.truncated == first.truncated[::-1]
    assert again.logprobs == first.logprobs[::-1]  # JSON round-trips floats exactly
    with pytest.raises(GenerationError, match=r"no recorded completion for dataset row 9, generation 1"):
        replay.generate(None, prompts[:1], [(9, 1)])
    (tmp_path / "bad.jsonl").write_text('{"row": 1}\n')
    with pytest.raises(GenerationError, match=r"bad.jsonl, line 1: expected a JSON object with row"):
        Replay.load(tmp_path / "bad.jsonl")


# ------------------------------------------------------------------ generation_weights, one process


def test_generation_weights_sets_and_restores_inference_flags_also_on_error():
    from types import SimpleNamespace

    from fusedalign.backbone import compile_decoder_layers, decoder_layers
    from fusedalign.distributed import generation_weights

    model = load_model("builtin:tiny-qwen2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model.model.layers[1].eval()  # a module in its own mode must get it back
    model.config.use_cache = False
    compile_decoder_layers(model, recompute="default", backend="eager")  # --compile_layers
    acc = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=None), unwrap_model=lambda m: m)
    layers = [m for m in model.modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)]
    assert layers and all(m.gradient_checkpointing for m in layers)
    compiled = [(m, m._fusedalign_forwards) for m in decoder_layers(model)]
    assert len(compiled) == 2 and all(m.forward is fwd[1] for m, fwd in compiled)
    with pytest.raises(RuntimeError, match="boom"):
        with generation_weights(model, acc) as whole:
            assert whole is model and not torch.is_grad_enabled()
            assert not any(m.training for m in model.modules())
            assert not any(m.gradient_checkpointing for m in layers) and model.config.use_cache is True
            assert all(m.forward is fwd[0] for m, fwd in compiled)  # generation runs the eager layers
            raise RuntimeError("boom")
    assert torch.is_grad_enabled() and model.training and not model.model.layers[1].training
    assert model.model.layers[0].training
    assert all(m.gradient_checkpointing for m in layers) and model.config.use_cache is False
    assert all(m.forward is fwd[1] for m, fwd in compiled)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_static_decoding_equals_dynamic_on_gpu(tiny):
    _, tok = tiny
    model = load_model("builtin:tiny-qwen2").cuda().eval()
    prompts = _prompts(tok, ["Beautiful is", "Errors should never", "Now"])
    keys = [(0, 0), (1, 0), (2, 0)]
    kw = dict(max_new_tokens=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for sampler in (None, 7):
        make = lambda **extra: HFGenerate(**kw, do_sample=False,  # noqa: E731
                                          sampler=None if sampler is None else KeyedSampler(sampler), **extra)
        dynamic = make().generate(model, prompts, keys)
        compiled = make(compile_decoding=True).generate(model, prompts, keys)
        assert compiled.completion_ids == dynamic.completion_ids
