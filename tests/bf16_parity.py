"""What the bf16 parity tests on a GPU share (tests/unit/test_grpo_packed_gpu.py,
tests/unit/test_distillation_gpu.py): a real model shape with fewer layers, saved so that the
trainers load it as a user's checkpoint, and the accuracy criterion of Cut Cross-Entropy.

The criterion: a truth run in float32 (no TF32); two runs in the dtype under test, the
ordinary computation (the baseline) and ours. Ours may err against the truth no more than
`SLACK` x the baseline's error plus a floor, for each metric's largest error over the steps
and for the weights' change (the norm of its difference). In float32 the baseline is the truth
itself (error 0), so ours must equal it within the floor alone.
"""

from __future__ import annotations

import torch

SLACK = 3.0
FLOOR = {torch.bfloat16: 1e-3, torch.float32: 1e-5}  # relative to the largest value compared


def save_shaped_model(path: str, shape: dict, layers: int, seed: int = 0) -> str:
    """Saves a float32 Qwen2 of `shape` (a benchmarks.builders.model shape) with `layers` layers and
    its own tied head, random init (built on CUDA where present: fast), and the tiny Qwen2 tokenizer
    (ids < 512, valid in any vocabulary). Returns `path`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fusedalign.models import load_tokenizer

    config = Qwen2Config(**{**shape, "num_hidden_layers": layers}, tie_word_embeddings=True, use_cache=False,
                         max_position_embeddings=4096, pad_token_id=0, eos_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    load_tokenizer("builtin:tiny-qwen2").save_pretrained(path)
    return path


def no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def assert_within(dtype: torch.dtype, keys: tuple[str, ...], truth, baseline, ours, name: str = "") -> None:
    """Each run: (per-step logs [dicts], the weights' change [flat tensor]). Asserts the criterion."""
    (t_logs, t_delta), (b_logs, b_delta), (o_logs, o_delta) = truth, baseline, ours
    assert len(t_logs) == len(b_logs) == len(o_logs) >= 2
    for key in keys:  # over the steps that log it (RLOO logs its kl at generation only)
        steps = [i for i, e in enumerate(t_logs) if key in e]
        assert steps and all(key in logs[i] for logs in (b_logs, o_logs) for i in steps), key
        want = [t_logs[i][key] for i in steps]
        err = max(abs(o_logs[i][key] - w) for i, w in zip(steps, want))
        base = max(abs(b_logs[i][key] - w) for i, w in zip(steps, want))
        floor = FLOOR[dtype] * max(1.0, *(abs(w) for w in want))
        print(f"{name} {key}: error {err:.3g}, baseline's {base:.3g}, floor {floor:.3g}")  # shown with pytest -s
        assert err <= SLACK * base + floor, (name, key, err, base, floor)
    assert float(t_delta.norm()) > 0  # training moved the weights
    err, base = float((o_delta - t_delta).norm()), float((b_delta - t_delta).norm())
    print(f"{name} weights' change: error {err:.3g}, baseline's {base:.3g}, norm {float(t_delta.norm()):.3g}")
    assert err <= SLACK * base + FLOOR[dtype] * float(t_delta.norm()), (name, "weights", err, base)
