"""Fused projections while decoding (`generation/fused_projections.py`): the same logits and
tokens as the model's own projections, every module as it was afterwards, LoRA layers left
alone, and one graph under dynamo."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedalign.generation import KeyedSampler, StaticDecode
from fusedalign.generation.fused_projections import fused_projections
from fusedalign.models import load_model, load_tokenizer

MODELS = ("builtin:tiny-qwen2", "builtin:tiny-llama", "builtin:tiny-gemma2")


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 400, (3, 11), generator=g)


def _structure(model: nn.Module) -> list:
    """Every module, by name, as the object it is, and whether it carries an instance forward."""
    return [(name, id(m), "forward" in vars(m)) for name, m in model.named_modules()]


@pytest.mark.parametrize("name", MODELS)
def test_every_layer_is_fused_and_the_logits_stay_those_of_the_model(name):
    model = load_model(name, attn_implementation="eager").eval()
    layers = model.config.num_hidden_layers
    ids = _inputs()
    with torch.no_grad():
        want = model(ids).logits
        before = _structure(model)
        with fused_projections(model) as fused:
            assert (fused.mlps, fused.attentions) == (layers, layers)
            got = model(ids).logits
            assert _structure(model) != before  # the fusion is in place inside the block
        assert _structure(model) == before
        again = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, want)


def test_the_fused_weights_are_those_of_the_first_call_and_nothing_changes_the_model():
    # The copies are taken at each module's first call in the block (under FSDP2 the weights are
    # whole only inside the forward), so weights changed before it are seen; the model itself is
    # left as it was.
    model = load_model("builtin:tiny-qwen2").eval()
    ids = _inputs(1)
    with torch.no_grad():
        with fused_projections(model):
            for p in model.parameters():  # what a ZeRO-3 gather or an FSDP2 unshard makes whole
                p.add_(torch.randn_like(p) * 0.05)
            got = model(ids).logits
        state = {k: v.clone() for k, v in model.state_dict().items()}
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_an_error_inside_the_block_leaves_every_module_as_it_was():
    model = load_model("builtin:tiny-llama").eval()
    before = _structure(model)
    with pytest.raises(RuntimeError, match="inside"):
        with fused_projections(model):
            raise RuntimeError("inside")
    assert _structure(model) == before


def test_lora_projections_are_left_as_they_are():
    from peft import LoraConfig, get_peft_model

    base = load_model("builtin:tiny-qwen2").eval()
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "up_proj"], lora_dropout=0.0))
    for n, p in lora.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.1)  # the adapter changes the output
    ids = _inputs(2)
    with torch.no_grad():
        want = lora(input_ids=ids).logits
        with fused_projections(lora) as fused:
            assert (fused.mlps, fused.attentions) == (0, 0)
            got = lora(input_ids=ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", MODELS[:2])  # tiny-gemma2's sliding windows send StaticDecode to generate
def test_static_decode_gives_the_same_tokens_fused(name):
    """Greedy and keyed sampling: every token and the sampler's log-probs as unfused."""
    model, tok = load_model(name).eval(), load_tokenizer(name)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in (3, 7, 5, 1)]
    keys = [(i, 0) for i in range(len(prompts))]
    for flags in (dict(do_sample=False), dict(sampler=True)):
        def make(**more):
            sampler = KeyedSampler(5, temperature=0.8) if flags.get("sampler") else None
            return StaticDecode(max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                do_sample=flags.get("do_sample", True), sampler=sampler, **more)

        want = make().generate(model, prompts, keys, step=1)
        decode = make(fuse_projections=True)
        got = decode.generate(model, prompts, keys, step=1)
        layers = model.config.num_hidden_layers
        assert decode.last_call["fused_projections"] == {"mlps": layers, "attentions": layers}
        assert got.completion_ids == want.completion_ids and got.truncated == want.truncated
        if want.logprobs is not None:
            for a, b in zip(got.logprobs, want.logprobs):
                assert a == pytest.approx(b, abs=1e-5)
    assert StaticDecode(max_new_tokens=1, eos_token_id=0, pad_token_id=0).fuse_projections is False  # opt-in


def test_a_fused_forward_is_one_graph_under_dynamo():
    # The compiled decoding step (compile_step) traces the fused projections: no graph break.
    model = load_model("builtin:tiny-qwen2").eval()
    ids = _inputs(4)
    torch._dynamo.reset()
    with torch.no_grad(), fused_projections(model):
        compiled = torch.compile(lambda x: model(x).logits, backend="eager", fullgraph=True)
        got = compiled(ids)
        want_fused = model(ids).logits
    torch._dynamo.reset()
    assert torch.equal(got, want_fused)


def _cuda_qwen2(dtype, **shape):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, tie_word_embeddings=True, **shape)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).cuda().eval()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_decoding_fused_equals_unfused(compiled):
    """float32, greedy: the fused loop's tokens from CUDA-graph replays (of the compiled step or
    not) equal the unfused eager loop's, and weights changed in place between calls are seen
    (the fused copies are taken at each call)."""
    tok = load_tokenizer("builtin:tiny-qwen2")
    model = _cuda_qwen2(torch.float32, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=512)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in (3, 7, 5, 1, 9)]
    keys = [(i, 0) for i in range(len(prompts))]
    kw = dict(max_new_tokens=40, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False)
    fused = StaticDecode(**kw, compact_below=0, compile_step=compiled, fuse_projections=True)
    plain = StaticDecode(**kw, cuda_graphs=False)
    before = fused.generate(model, prompts, keys).completion_ids
    assert fused.last_call["graph"] is True and fused.last_call["compiled"] is compiled
    assert fused.last_call["fused_projections"] == {"mlps": 4, "attentions": 4}
    assert before == plain.generate(model, prompts, keys).completion_ids
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = fused.generate(model, prompts, keys).completion_ids
    assert after == plain.generate(model, prompts, keys).completion_ids and after != before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_fused_logits_err_no_more_than_unfused_on_the_05b_shape():
    """bf16 at Qwen2.5-0.5B's shape: against the float32 model's logits, the fused forward's error
    is no larger than the unfused bf16 forward's (plus a small tolerance): the fusion changes how
    a dot product is summed, not how precisely."""
    shape = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864)
    model = _cuda_qwen2(torch.float32, **shape)
    ids = torch.randint(1, 151000, (64, 33), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        truth = model(ids).logits.double()
        model.to(torch.bfloat16)
        plain = model(ids).logits.double()
        with fused_projections(model) as fused:
            assert fused.attentions == 24 and fused.mlps == 24
            got = model(ids).logits.double()
    plain_err, fused_err = (plain - truth).abs().max().item(), (got - truth).abs().max().item()
    assert fused_err <= plain_err * 1.25 + 1e-3, (fused_err, plain_err)
