"""benchmarks/builders/ending.py: a random model's completions end at lengths of the stated
distribution, the same under transformers' generate and StaticDecode (with its compaction)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.builders import ending  # noqa: E402
from benchmarks.builders.lengths import LengthFit  # noqa: E402
from fusedalign.generation import HFGenerate, StaticDecode  # noqa: E402
from fusedalign.models import load_model, load_tokenizer  # noqa: E402

FIT = LengthFit(6, 20)
MAX_NEW = 24


def test_hazards_give_the_fits_survival():
    h = ending.hazards(FIT, MAX_NEW)
    alive = 1.0
    for k in range(MAX_NEW):
        assert math.isclose(alive, ending.survival(FIT, k), rel_tol=1e-9, abs_tol=1e-12)
        alive *= 1 - h[k]
    assert math.isclose(ending.survival(FIT, 6) + 0.0, 0.5, abs_tol=0.05)  # the median
    assert ending.parse_fit("fixed") is None and ending.parse_fit("lognormal:300:1500") == LengthFit(300, 1500)
    with pytest.raises(ValueError, match="MEDIAN < P95"):
        ending.parse_fit("lognormal:300:100")


@pytest.mark.parametrize("generator", ["generate", "static"])
def test_completion_lengths_follow_the_fit_under_either_generator(generator):
    model, tok = load_model("builtin:tiny-qwen2").eval(), load_tokenizer("builtin:tiny-qwen2")
    eos = model.config.vocab_size - 1
    rows = 768
    prompts = [[5, 9, 13, 17]] * rows
    cls = HFGenerate if generator == "generate" else StaticDecode
    decode = cls(max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=tok.pad_token_id, temperature=1.0)
    ids = torch.tensor([[5, 9, 13, 17]])
    before = model(input_ids=ids).logits
    handle = ending.end_at_lengths(model, FIT, eos, MAX_NEW)
    try:
        torch.manual_seed(0)
        out = decode.generate(model, prompts, [(i, 0) for i in range(rows)])
        assert torch.equal(model(input_ids=ids).logits, before)  # a forward without a cache is left alone
    finally:
        handle.remove()
    lengths = torch.tensor([len(c) for c in out.completion_ids], dtype=torch.float64)
    for k in (2, 6, 12, 20):  # P(L > k): binomial standard error at most 0.018 over 768 rows
        assert abs(float((lengths > k).double().mean()) - ending.survival(FIT, k)) < 0.06, k
    assert all(c[-1] == eos for c, cut in zip(out.completion_ids, out.truncated) if not cut)
    if generator == "static":
        assert len(decode.last_call["batch_sizes"]) >= 2  # the compaction ran, and changed nothing


def test_the_benchmark_model_generates_with_a_kv_cache(tmp_path):
    """transformers' generate (TRL's sampler) takes unset fields from the model's generation config:
    the benchmark model must say use_cache there, or TRL's runs recompute every prefix."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from benchmarks.builders.model import build_model

    build_model(str(tmp_path), tiny=True, dtype="fp32", seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    widths = []
    model.register_forward_hook(lambda m, a, k, o: widths.append(k["input_ids"].shape[1]), with_kwargs=True)
    ids = torch.tensor([[5, 9, 13, 17]])
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                   generation_config=GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0))
    assert widths == [4, 1, 1]


def test_the_hook_makes_no_tensor_from_host_data_while_decoding(monkeypatch):
    """A decoding step captured as a CUDA graph may not copy from the host: the hook's tensors are
    made when it is installed (a torch.tensor inside it failed under StaticDecode's capture on CUDA)."""
    from types import SimpleNamespace

    model = load_model("builtin:tiny-qwen2").eval()
    eos = model.config.vocab_size - 1
    handle = ending.end_at_lengths(model, FIT, eos, MAX_NEW)
    try:
        hook = model._forward_hooks[handle.id]
        logits = torch.zeros(3, 1, model.config.vocab_size)

        def refuse(*args, **kwargs):
            raise AssertionError("torch.tensor called while decoding")

        monkeypatch.setattr(torch, "tensor", refuse)
        for _ in range(2):  # a step as replayed: one new token a row
            hook(model, (), {"input_ids": torch.zeros(3, 1, dtype=torch.long), "past_key_values": object()},
                 SimpleNamespace(logits=logits))
    finally:
        monkeypatch.undo()
        handle.remove()
    # The EOS logit now gives the hazard of completion position 2 (k advanced twice from 0).
    h = ending.hazards(FIT, MAX_NEW)[2]
    p_eos = torch.softmax(logits[:, -1].double(), -1)[:, eos]
    torch.testing.assert_close(p_eos, torch.full((3,), h, dtype=torch.float64), rtol=1e-5, atol=1e-7)


def test_the_hook_inside_a_captured_step_holds_to_the_capture_rules(monkeypatch):
    """StaticDecode's step with the hook installed, in stand-in graphs held to what a CUDA graph's
    capture accepts (tests/stand_in_graphs.py): the same completions as the eager loop from one seed.
    The hook's first version, which made a tensor from host data in the step, fails here."""
    from tests.stand_in_graphs import eager_and_stand_in

    model, tok = load_model("builtin:tiny-qwen2").eval(), load_tokenizer("builtin:tiny-qwen2")
    eos = model.config.vocab_size - 1
    prompts, keys = [[5, 9, 13, 17], [7, 3], [11]] * 8, [(i, 0) for i in range(24)]
    handle = ending.end_at_lengths(model, FIT, eos, MAX_NEW)
    try:
        want, got, decode, captured = eager_and_stand_in(
            monkeypatch, model, prompts, keys, 0, max_new_tokens=MAX_NEW, eos_token_id=eos,
            pad_token_id=tok.pad_token_id, temperature=1.0, window_slots=8, check_every=2)
    finally:
        handle.remove()
    assert decode.last_call["graph"] is True and len(captured) >= 2
    assert got.completion_ids == want.completion_ids
    assert len({len(c) for c in got.completion_ids}) > 3  # the hook ended the rows at many lengths
