"""StaticDecode's compaction: once most rows have finished, the live ones continue as a batch of
their own, and every row's tokens (and a keyed sampler's log-probs) are what they would have been
without it, and what transformers' generate gives."""

from __future__ import annotations

import pytest
import torch

from fusedalign.generation import HFGenerate, KeyedSampler, StaticDecode
from fusedalign.models import load_model, load_tokenizer

PROMPT_LENGTHS = (3, 7, 5, 1, 9, 4, 6, 2)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 400, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _keys(n: int) -> list[tuple[int, int]]:
    return [(i, i % 2) for i in range(n)]


def _uneven_eos(model, tok, prompts, step=0, **flags) -> list[int]:
    """End-of-sequence ids that end most rows early and leave others decoding: the token three
    rows draw at their first and second positions, the rest run on (checked by the callers)."""
    free = StaticDecode(max_new_tokens=30, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        compact_below=0, **flags).generate(model, prompts, _keys(len(prompts)), step=step)
    ids = free.completion_ids
    return sorted({ids[0][1], ids[1][0], ids[2][2], ids[3][1], ids[4][0]})


@pytest.mark.parametrize("name,attn", [("builtin:tiny-qwen2", "sdpa"), ("builtin:tiny-qwen2", "eager"),
                                       ("builtin:tiny-llama", "sdpa"), ("builtin:tiny-llama", "eager"),
                                       ("builtin:tiny-gemma2", "eager")])  # (transformers has no sdpa for Gemma 2)
@pytest.mark.parametrize("flags", [dict(do_sample=False), dict(do_sample=False, repetition_penalty=1.4),
                                   dict(temperature=0.7, top_k=30, top_p=0.9, keyed=True)],
                         ids=["greedy", "penalty", "keyed"])
def test_compacted_decoding_gives_every_row_the_tokens_it_gets_alone(name, attn, flags):
    """Gemma 2 has sliding-window layers: StaticDecode declares its fallback to transformers' generate
    (no compaction there), and compact_below set changes nothing (generate's tokens)."""
    model, tok = load_model(name, attn_implementation=attn).eval(), load_tokenizer(name)
    assert model.config._attn_implementation == attn
    flags = dict(flags)
    keyed = flags.pop("keyed", False)
    prompts, keys = _prompts(), _keys(len(PROMPT_LENGTHS))

    def make(cls, **more):
        sampler = KeyedSampler(3, temperature=0.7, top_k=30, top_p=0.9) if keyed else None
        return cls(max_new_tokens=30, eos_token_id=eos, pad_token_id=tok.pad_token_id, sampler=sampler,
                   **flags, **more)

    eos = _uneven_eos(model, tok, prompts, step=1, **flags,
                      **({"sampler": KeyedSampler(3, temperature=0.7, top_k=30, top_p=0.9)} if keyed else {}))
    compacting = make(StaticDecode, check_every=2, compact_below=0.5)
    got = compacting.generate(model, prompts, keys, step=1)
    plain = make(StaticDecode, check_every=2, compact_below=0)
    want = plain.generate(model, prompts, keys, step=1)
    if "gemma2" in name:
        assert compacting.last_call == plain.last_call == {"path": "generate", "why": "sliding-window layers"}
    else:
        sizes = compacting.last_call["batch_sizes"]
        assert len(sizes) >= 2 and sizes[0] == len(prompts) and all(b < a for a, b in zip(sizes, sizes[1:])), sizes
        assert plain.last_call["batch_sizes"] == [len(prompts)]
    lengths = [len(c) for c in got.completion_ids]
    assert min(lengths) <= 3 and max(lengths) >= 10, lengths  # the rows really end unevenly
    assert got.completion_ids == want.completion_ids and got.truncated == want.truncated
    assert got.completion_ids == make(HFGenerate).generate(model, prompts, keys, step=1).completion_ids
    if keyed:
        for a, b in zip(got.logprobs, want.logprobs):  # a smaller batch's matmuls round differently
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_compaction_flag_is_checked():
    with pytest.raises(ValueError, match="compact_below"):
        StaticDecode(max_new_tokens=4, eos_token_id=1, pad_token_id=0, compact_below=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compaction_under_cuda_graphs_equals_eager_and_generate():
    """Each compaction captures a graph for the live rows: their greedy tokens are the eager loop's
    and generate's."""
    from tests.unit.test_static_decode import _cuda_model

    tok = load_tokenizer("builtin:tiny-qwen2")
    model = _cuda_model()
    prompts, keys = _prompts() * 8, _keys(8 * len(PROMPT_LENGTHS))
    eos = _uneven_eos(model, tok, prompts, do_sample=False)
    kw = dict(max_new_tokens=40, eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=False, check_every=2)
    graphed = StaticDecode(**kw)
    got = graphed.generate(model, prompts, keys).completion_ids
    assert graphed.last_call["graphs"] >= 2 and len(graphed.last_call["batch_sizes"]) >= 2, graphed.last_call
    assert got == StaticDecode(**kw, cuda_graphs=False, compact_below=0).generate(model, prompts, keys).completion_ids
    assert got == HFGenerate(**{k: v for k, v in kw.items() if k != "check_every"}).generate(
        model, prompts, keys).completion_ids
