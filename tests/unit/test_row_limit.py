"""RowLimited (`generation/row_limit.py`): a generation batch decoded a few rows at a time gives the
tokens of one call over the whole batch, in the batch's order; `generation_max_rows` builds it."""

from __future__ import annotations

import pytest
import torch

from fusedalign.configs import GRPOConfig
from fusedalign.generation import GenerationOutput, HFGenerate, KeyedSampler, RowLimited, StaticDecode
from fusedalign.models import load_model, load_tokenizer
from fusedalign.trainers.rollout_setup import default_generator

PROMPT_LENGTHS = (3, 7, 5, 1, 9)  # the parts 2 + 2 + 1 rows; left padding differs within and across parts


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 400, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


class _Calls:
    """A generator that records the rows of each call and answers each prompt with itself reversed."""

    def __init__(self):
        self.calls: list[list[tuple[int, int]]] = []
        self.last_call = None

    def generate(self, model, prompt_ids, row_keys, *, step=0):
        self.calls.append(list(row_keys))
        self.last_call = {"rows": len(row_keys), "step": step}
        return GenerationOutput([list(reversed(p)) for p in prompt_ids], [len(p) > 4 for p in prompt_ids],
                                [[float(k[0])] * len(p) for p, k in zip(prompt_ids, row_keys)])


def test_parts_are_consecutive_rows_in_order_and_outputs_join_in_order():
    inner, prompts = _Calls(), _prompts()
    keys = [(i, i % 2) for i in range(len(prompts))]
    out = RowLimited(inner, 2).generate(None, prompts, keys, step=7)
    assert inner.calls == [keys[0:2], keys[2:4], keys[4:5]]
    assert out.completion_ids == [list(reversed(p)) for p in prompts]
    assert out.truncated == [len(p) > 4 for p in prompts]
    assert out.logprobs == [[float(i)] * len(p) for i, p in enumerate(prompts)]
    assert RowLimited(inner, 2).last_call == {"rows": 1, "step": 7}  # the wrapped generator's, read through
    RowLimited(inner, 2).check_every = 3  # and set through: every part's call sees it
    assert inner.check_every == 3 and "check_every" not in vars(RowLimited(inner, 2))
    inner.calls.clear()
    RowLimited(inner, 8).generate(None, prompts, keys)  # no more rows than the limit: one call
    assert inner.calls == [keys]
    with pytest.raises(ValueError, match=r"^max_rows must be >= 1, got 0$"):
        RowLimited(inner, 0)
    with pytest.raises(ValueError, match=r"^5 prompts but 4 row keys$"):
        RowLimited(inner, 2).generate(None, prompts, keys[:4])


@pytest.mark.parametrize("backend", ["static", "generate"])
@pytest.mark.parametrize("keyed", [False, True], ids=["greedy", "keyed"])
def test_two_rows_at_a_time_give_the_tokens_of_one_call(backend, keyed):
    """Greedy tokens and keyed draws depend on the row alone: decoding 2 + 2 + 1 rows gives every
    token, truncation flag and sampler log-prob of one call over the 5 rows."""
    name = "builtin:tiny-qwen2"
    model, tok = load_model(name).eval(), load_tokenizer(name)

    def generator():
        kw = dict(max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  do_sample=keyed, sampler=KeyedSampler(5, temperature=0.8) if keyed else None)
        return StaticDecode(**kw) if backend == "static" else HFGenerate(**kw)

    prompts = _prompts()
    keys = [(i, i % 2) for i in range(len(prompts))]
    whole = generator().generate(model, prompts, keys, step=3)
    limited = RowLimited(generator(), 2)
    parts = limited.generate(model, prompts, keys, step=3)
    assert parts.completion_ids == whole.completion_ids
    assert parts.truncated == whole.truncated
    assert any(len(c) > 3 for c in parts.completion_ids) and len(set(map(tuple, parts.completion_ids))) > 1
    if keyed:
        assert parts.logprobs is not None
        for got, want in zip(parts.logprobs, whole.logprobs):
            assert got == pytest.approx(want, abs=1e-5)
    if backend == "static":
        assert limited.last_call["batch_sizes"][0] == 1  # the last part: the fifth row alone


def test_generation_max_rows_builds_the_row_limited_generator():
    tok = load_tokenizer("builtin:tiny-qwen2")

    def make(**kw):
        return GRPOConfig(output_dir="/tmp/row-limit-test", report_to="none", per_device_train_batch_size=8, **kw)

    assert make().generation_max_rows == 0
    plain = default_generator(make(), tok)
    assert not isinstance(plain, RowLimited)
    limited = default_generator(make(generation_max_rows=2, generation_backend="static"), tok)
    assert isinstance(limited, RowLimited) and limited.max_rows == 2
    assert isinstance(limited.generator, StaticDecode)
    assert isinstance(default_generator(make(generation_max_rows=3, generation_backend="generate"), tok).generator,
                      HFGenerate)
