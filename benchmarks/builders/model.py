"""The model every benchmark run starts from: a Qwen2.5-0.5B-shaped random init (and, for
distillation, a Qwen2.5-1.5B-shaped teacher with the same vocabulary and tokenizer).

Built once per benchmark from a seed, in the training dtype, saved to a directory and
loaded by path by every run, so every configuration trains the same weights and each
loads them as a user would (`from_pretrained`).
"""

from __future__ import annotations

# Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes (both tie the head to the embedding); TINY and
# TINY_TEACHER shrink them for a CPU smoke test, keeping one vocabulary per pair.
QWEN05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
               intermediate_size=4864, vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
QWEN15B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
               intermediate_size=8960, vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, rope_theta=10_000.0, rms_norm_eps=1e-6)
TINY_TEACHER = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=192, vocab_size=512, rope_theta=10_000.0, rms_norm_eps=1e-6)
SHAPES = {("0.5b", False): QWEN05B, ("0.5b", True): TINY, ("1.5b", False): QWEN15B, ("1.5b", True): TINY_TEACHER}


def model_config(tiny: bool, longest: int = 0, shape: str = "0.5b"):
    """A Qwen2Config of that shape ("0.5b" or "1.5b"), with room for `longest` positions (at least 32768)."""
    from transformers import Qwen2Config

    shape = SHAPES[shape, tiny]
    return Qwen2Config(
        **shape, tie_word_embeddings=True, max_position_embeddings=max(32768, longest),
        hidden_act="silu", attention_dropout=0.0, use_sliding_window=False, use_cache=False,
        pad_token_id=0, bos_token_id=None, eos_token_id=0,
    )


def build_model(path: str, *, tiny: bool, dtype: str, seed: int, longest: int = 0, shape: str = "0.5b",
                device: str = "cpu") -> str:
    """Seeds, builds and saves the model of `shape` (and the tiny Qwen2 tokenizer) to `path`.

    `device` is where the random init runs. On the CPU the whole build took 51 s for the 1.5B
    shape and 28 s for the 0.5B one on an H100 machine (2026-12-05), most of it the init;
    `gpu_record.sh` builds with "cuda". The weights then come from CUDA's generator, not the
    CPU's (another random model of the same shape): every configuration of a run loads the one
    saved model either way. Tests build on the CPU.

    Returns:
        A one-line description (class, parameter count, dtype, path).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from fusedalign.models import load_tokenizer

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(tiny, longest, shape), dtype=torch.float32)
    model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    # Generation keeps a KV cache, as a released checkpoint's generation config has it: transformers'
    # generate (TRL's sampler) takes every field its caller leaves unset from here, and the config's
    # use_cache=False (for the training forwards) would otherwise make it recompute every prefix.
    model.generation_config.use_cache = True
    model.save_pretrained(path)
    load_tokenizer("builtin:tiny-qwen2").save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    return f"{type(model).__name__} {n / 1e6:.1f}M parameters, {dtype}, initialised on {device}, saved to {path}"
