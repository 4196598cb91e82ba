"""`--tiled_mlp_tokens`: each decoder layer's MLP over tiles of tokens (fusedalign/tiled_mlp.py).

Training with tiled MLPs against whole ones, on every backend, is in
tests/distributed/test_grpo_parity.py (`packed_tiled_ckpt`), and with a teacher in
tests/unit/test_distillation_trainer.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

from fusedalign.backbone import compile_decoder_layers, decoder_layers
from fusedalign.configs import GRPOConfig
from fusedalign.models import load_model
from fusedalign.tiled_mlp import tile_mlps
from tests.unit.test_backbone import H, I, saved_bytes_per_token, small_qwen2

MODELS = ["builtin:tiny-qwen2", "builtin:tiny-llama", "builtin:tiny-gemma2"]


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, name: str, rtol: float = 1e-5) -> None:
    """Within float32 rounding of the tensor's own scale (smaller matmuls round differently)."""
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= rtol * scale, (name, err, scale)


def _loss_and_grads(model, ids: torch.Tensor, *, checkpointing: bool = False):
    model.zero_grad(set_to_none=True)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    # A loss that weights every position differently, so a tile's rows cannot trade places unseen.
    weights = torch.linspace(-1, 1, out.logits.numel()).view_as(out.logits)
    loss = (out.logits.float() * weights).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_training_equals_whole_mlps(name, checkpointing):
    """Loss and every gradient, tiles of 7 over 2 x 13 tokens (the last tile of 5), with and without
    gradient checkpointing of the layers."""
    ids = torch.randint(3, 200, (2, 13), generator=torch.Generator().manual_seed(1))
    whole = load_model(name, attn_implementation="eager")
    want_loss, want = _loss_and_grads(whole, ids, checkpointing=checkpointing)
    tiled = load_model(name, attn_implementation="eager")
    assert tile_mlps(tiled, 7) == len(decoder_layers(tiled)) > 0
    got_loss, got = _loss_and_grads(tiled, ids, checkpointing=checkpointing)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-4)
    assert got.keys() == want.keys()
    for n in want:
        assert_close_to_scale(got[n], want[n], n)


def test_without_gradients_the_tiles_are_joined_in_order():
    model = load_model("builtin:tiny-qwen2")
    ids = torch.randint(3, 200, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        tile_mlps(model, 4)
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_mlp_calls_its_own_forward_once_per_tile():
    """Tiles of 4 over 2 x 5 tokens: 3 calls of 4, 4 and 2 tokens; a batch within one tile: one call."""
    model = small_qwen2()
    mlp = decoder_layers(model)[0].mlp
    sizes: list[int] = []
    inner = mlp.forward
    mlp.forward = lambda x: (sizes.append(x.reshape(-1, H).shape[0]), inner(x))[1]
    tile_mlps(model, 4)
    with torch.no_grad():
        model(input_ids=torch.ones(2, 5, dtype=torch.long))
        assert sizes == [4, 4, 2]
        sizes.clear()
        model(input_ids=torch.ones(1, 4, dtype=torch.long))
        assert sizes == [4]


def test_a_tiled_layer_keeps_none_of_its_mlp_activations():
    """Autograd's saved tensors of a decoder layer, float32 (the small Qwen2 of test_backbone): tiling
    removes exactly the MLP's four intermediates (gate, up, SiLU(gate), their product), 4 x 4 I bytes a
    token; the MLP's input stays, the tiles' backward recomputes from it."""
    whole = saved_bytes_per_token(small_qwen2())
    tiled_model = small_qwen2()
    tile_mlps(tiled_model, 16)
    tiled = saved_bytes_per_token(tiled_model)
    assert whole - tiled == 4 * 4 * I, (whole, tiled)


def test_tiling_twice_is_tiling_once():
    model = small_qwen2()
    assert tile_mlps(model, 8) == 2
    assert tile_mlps(model, 8) == 0
    assert decoder_layers(model)[0].mlp._fusedalign_tile_tokens == 8


def test_a_mixture_of_experts_is_refused():
    model = small_qwen2()

    class SparseMoeBlock(torch.nn.Module):
        def forward(self, x):
            return x

    decoder_layers(model)[1].mlp = SparseMoeBlock()
    with pytest.raises(ValueError, match=r"--tiled_mlp_tokens: Qwen2DecoderLayer has no dense token-wise MLP at "
                                         r"\.mlp \(found SparseMoeBlock\)"):
        tile_mlps(model, 8)


@pytest.mark.parametrize("tokens", [0, -3])
def test_tiles_of_no_token_are_refused(tokens):
    with pytest.raises(ValueError, match="--tiled_mlp_tokens must be >= 1"):
        tile_mlps(small_qwen2(), tokens)


def test_the_config_refuses_a_negative_tile(tmp_path):
    with pytest.raises(ValueError, match=r"--tiled_mlp_tokens must be >= 0 \(0 leaves the MLPs whole\); got -1"):
        GRPOConfig(output_dir=str(tmp_path), tiled_mlp_tokens=-1)


def test_checkpoint_is_non_reentrant_inside_a_reentrant_layer_checkpoint():
    """Under transformers' reentrant checkpointing (use_reentrant=True) the tiles' own checkpoints
    still give the whole MLP's gradients."""
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(3))
    whole = small_qwen2()
    whole.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    whole.train()
    tiled = small_qwen2()
    tiled.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    tiled.train()
    tile_mlps(tiled, 4)
    grads = []
    for model in (whole, tiled):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        model(inputs_embeds=embeds, use_cache=False).logits.sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    want, got = grads
    # Every parameter but the embedding (its output was detached) has its gradient.
    assert set(got) == set(want) == {n for n, _ in whole.named_parameters()} - {"model.embed_tokens.weight"}
    for n in want:
        assert_close_to_scale(got[n], want[n], n)


def test_compiled_layers_run_the_tiles_too():
    """`--compile_layers` over tiled MLPs (dynamo traces each tile's checkpoint): the same loss and
    gradients as whole, uncompiled MLPs."""
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(4))
    whole = small_qwen2()
    want_loss, want = _loss_and_grads(whole, ids)
    tiled = small_qwen2()
    tile_mlps(tiled, 16)
    compile_decoder_layers(tiled)
    got_loss, got = _loss_and_grads(tiled, ids)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-4)
    for n in want:
        assert_close_to_scale(got[n], want[n], n)


def _qwen05b_layers(layers: int = 2):
    """Two decoder layers of Qwen2.5-0.5B's shape (hidden 896, intermediate 4,864, 14 heads, 2 KV
    heads), a small vocabulary, bf16 on CUDA."""
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=layers, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=1024, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_on_the_gpu_tiles_cut_the_peak_by_the_mlp_activations(checkpointing):
    """16,384 tokens in one row through two layers of the 0.5B shape in bf16, tiles of 896 tokens:
    the same gradients to bf16 rounding, and a peak lower by at least the MLP intermediates of one
    layer's three largest (gate, up and their product, 3 x 16,384 x 4,864 x 2 bytes, 478 MB): without
    checkpointing each layer holds four for the backward; with it, the recomputed layer does."""
    ids = torch.randint(0, 1024, (1, 16384), generator=torch.Generator().manual_seed(5)).cuda()
    peaks, grads = [], []
    for tile in (0, 896):
        model = _qwen05b_layers()
        if tile:
            tile_mlps(model, tile)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        hidden.float().square().mean().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
        del model, hidden
    (whole, tiled), (want, got) = peaks, grads
    assert whole - tiled >= 3 * 16384 * 4864 * 2, (whole, tiled)
    assert got.keys() == want.keys()
    for n in want:
        assert_close_to_scale(got[n], want[n], n, rtol=3e-2)
