"""Backbone speed-ups: compiled decoder layers (`compile_layers`) and their memory bound.

Training parity of compiled layers (one process, DDP, ZeRO-2, FSDP2) is in
tests/distributed/test_dpo_parity.py; the ZeRO-3 refusal through the CLI in
tests/distributed/test_cli_launch.py.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

from fusedalign.backbone import compile_decoder_layers, decoder_layers, eager_layers
from fusedalign.configs import DPOConfig

H, I, KV = 64, 512, 32  # hidden, intermediate, key/value width (2 heads of 16)


def small_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config)


def saved_bytes_per_token(model: Qwen2ForCausalLM, tokens: int = 2 * 96) -> float:
    """Bytes that autograd keeps for the backward of the second decoder layer, per token.

    Every tensor saved inside the layer's call (by eager ops or by a compiled graph) is
    counted once per storage; parameters are not activations and are left out.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    layer = decoder_layers(model)[1]
    handles = [layer.register_forward_pre_hook(lambda *a, **k: hooks.__enter__(), with_kwargs=True),
               layer.register_forward_hook(lambda *a, **k: hooks.__exit__(None, None, None), with_kwargs=True)]
    ids = torch.randint(0, 300, (2, tokens // 2), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    for h in handles:
        h.remove()
    out.logits.sum().backward()
    return sum(saved.values()) / tokens


def test_default_recompute_keeps_more_in_the_same_process():
    """Policies never share compiled graphs: torch's default keeps the SiLU * up product."""
    model = small_qwen2()
    compile_decoder_layers(model, recompute="default")
    assert saved_bytes_per_token(model) > 4 * (2 * I + 5 * H + 2 * KV) + 64 + 4 * I // 2


def test_elementwise_recompute_saves_only_what_matmuls_and_attention_need():
    """fp32: the layer keeps gate and up [I each], and ~5 hidden-wide tensors (norm
    inputs/outputs, query, attention output), key and value, and per-token scalars. The
    SiLU(gate) * up product [I] and the fp32 norm intermediates are recomputed."""
    eager = saved_bytes_per_token(small_qwen2())
    model = small_qwen2()
    assert compile_decoder_layers(model, recompute="elementwise") == 2
    lean = saved_bytes_per_token(model)
    bound = 4 * (2 * I + 5 * H + 2 * KV) + 64
    assert lean <= bound, (lean, bound)
    assert eager > bound + 4 * I, (eager, bound)  # the recorder sees what eager saves


def test_compiled_layers_compute_what_eager_layers_compute():
    eager, compiled = small_qwen2(), small_qwen2()
    compile_decoder_layers(compiled)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    for model in (eager, compiled):
        model(input_ids=ids, use_cache=False).logits.square().mean().backward()
    torch.testing.assert_close(compiled.model.layers[0].mlp.up_proj.weight.grad,
                               eager.model.layers[0].mlp.up_proj.weight.grad, rtol=1e-4, atol=1e-6)
    assert all(getattr(layer, "_fusedalign_compiled", False) for layer in decoder_layers(compiled))


def _greedy(model: Qwen2ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                              do_sample=False, pad_token_id=0)


def test_generation_inside_eager_layers_compiles_nothing_and_training_still_compiles():
    """Decoding through the compiled forward compiles the layers' shared code again for the cache's
    state, the query's length and each layer's cache index (the recompile limit is 8: a 24-layer
    model's rollout spends it, and training's forwards then run eager). Inside `eager_layers` the
    same decoding compiles nothing and gives the same tokens; the compiled forward is back after,
    also after an error, and a training forward compiles."""
    ids = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(2))
    want = _greedy(small_qwen2().eval(), ids)

    def counting(graphs: list) -> Callable:
        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward
        return backend

    torch._dynamo.reset()  # the limit counts every earlier graph of the layers' code in this process
    inside, through = [], []
    shielded, exposed = small_qwen2().eval(), small_qwen2().eval()
    compile_decoder_layers(shielded, recompute="default", backend=counting(inside))
    compile_decoder_layers(exposed, recompute="default", backend=counting(through))
    layers = decoder_layers(shielded)
    with eager_layers(shielded) as swapped:
        assert swapped == 2 and all(m.forward is m._fusedalign_forwards[0] for m in layers)
        assert torch.equal(_greedy(shielded, ids), want)
    assert inside == [] and all(m.forward is m._fusedalign_forwards[1] for m in layers)
    with pytest.raises(RuntimeError, match="boom"):
        with eager_layers(shielded):
            raise RuntimeError("boom")
    assert all(m.forward is m._fusedalign_forwards[1] for m in layers)
    shielded.train()
    shielded(input_ids=ids, use_cache=False).logits.sum().backward()
    assert len(inside) == 1

    assert torch.equal(_greedy(exposed, ids), want)
    assert len(through) >= 3, len(through)  # prefill, decoding, the second layer's index at least
    with eager_layers(small_qwen2()) as swapped:  # nothing compiled: nothing to swap
        assert swapped == 0


def test_zero3_is_refused_and_unknown_policy_named():
    with pytest.raises(ValueError, match="not supported under DeepSpeed ZeRO-3"):
        compile_decoder_layers(small_qwen2(), zero3=True)
    with pytest.raises(ValueError, match="compile_recompute must be one of"):
        compile_decoder_layers(small_qwen2(), recompute="everything")


def test_torch_compile_means_compiled_layers_not_a_compiled_model(tmp_path):
    """Trainer's whole-model compile would trace the fused head; the flag is redirected."""
    args = DPOConfig(output_dir=str(tmp_path), torch_compile=True, report_to="none")
    assert args.compile_layers is True and args.torch_compile is False
    with pytest.raises(ValueError, match="--compile_recompute default"):
        DPOConfig(output_dir=str(tmp_path), torch_compile_mode="max-autotune", report_to="none")
    args = DPOConfig(output_dir=str(tmp_path), torch_compile_mode="max-autotune", compile_recompute="default",
                     report_to="none")
    assert args.compile_layers is True and args.torch_compile is False and args.torch_compile_mode is None
    assert args._layer_compile_options["mode"] == "max-autotune"
    assert DPOConfig(output_dir=str(tmp_path), report_to="none").compile_layers is False


def test_compiled_layers_with_checkpointing_warn_with_the_measurement(tmp_path):
    from transformers.testing_utils import CaptureLogger

    from fusedalign.configs import common

    with CaptureLogger(common.logger) as cl:
        DPOConfig(output_dir=str(tmp_path), compile_layers=True, gradient_checkpointing=True, report_to="none")
    assert "compile_layers with gradient_checkpointing" in cl.out and "--use_liger_kernel" in cl.out
    with CaptureLogger(common.logger) as cl:
        DPOConfig(output_dir=str(tmp_path), compile_layers=True, report_to="none")
    assert "gradient_checkpointing" not in cl.out
