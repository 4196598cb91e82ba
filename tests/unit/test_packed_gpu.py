"""CUDA (the H200): bf16 DPO on the Qwen2.5-0.5B shape trains alike on padded, padding-free and
shared-prompt rows, on each attention implementation that takes them.

The truth is the same training in fp32 (padded rows, sdpa, no TF32). In fp32 every packed layout
on flex attention equals it to rounding (a wrong mask, position or segment sum shows here). A bf16
run's distance to it is rounding; each packed layout's largest distance over the steps may be no
larger than the bf16 padded run's on the same attention implementation, times 3, plus a floor
(the accuracy criterion of Cut Cross-Entropy: no worse than the ordinary computation in the same
dtype). The largest over the steps, not each step: one step's error of the padded run can be small
by chance (on 2026-12-04 flex's padded run erred 7.5e-4 in one step's loss where every other
layout and step erred 3e-3 to 1e-2 on both implementations, while each layout's fp32 run was
within 1e-5). Compared: the loss, logps/chosen, logps/rejected and rewards/margins, and the
change of the weights.
Lengths follow UltraFeedback's shape (prompt median ~107, completions ~200, long tails), with
one-token completions and a pair longer than max_length.
"""

from __future__ import annotations

import importlib.util
import math
import random
from collections import Counter

import pytest
import torch
from datasets import Dataset

from fusedalign.configs import DPOConfig
from fusedalign.models import load_model
from fusedalign.trainers.dpo import DPOTrainer
from tests.head_calls import HeadCalls

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 151936
COMPARED = ("loss", "logps/chosen", "logps/rejected", "rewards/margins")
LAYOUTS = {"padded": {}, "padding_free": dict(padding_free=True),
           "shared_prompt": dict(padding_free=True, share_prompt=True)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from benchmarks.builders.model import build_model

    path = str(tmp_path_factory.mktemp("qwen05b"))
    build_model(path, tiny=False, dtype="fp32", seed=0)
    return path


def _rows(n: int = 16, seed: int = 0) -> Dataset:
    g = random.Random(seed)

    def length(median: float, cap: int) -> int:
        return max(1, min(cap, int(g.lognormvariate(math.log(median), 0.7))))

    rows = [dict(prompt_ids=[g.randrange(1, VOCAB) for _ in range(length(107, 600))],
                 chosen_ids=[g.randrange(1, VOCAB) for _ in range(length(200, 700))],
                 rejected_ids=[g.randrange(1, VOCAB) for _ in range(length(183, 700))]) for _ in range(n)]
    rows[1]["chosen_ids"] = rows[1]["chosen_ids"][:1]
    rows[2]["rejected_ids"] = rows[2]["rejected_ids"][:1]
    return Dataset.from_list(rows)


def _train(model_dir: str, tmp, attn: str, bf16: bool, calls: Counter | None = None, **layout):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    args = DPOConfig(
        output_dir=str(tmp), bf16=bf16, max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        optim="sgd", learning_rate=0.1, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, beta=0.1, max_length=1024, train_sampling_strategy="sequential", logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=0, **layout,
    )
    # fp32 master weights; bf16 runs compute under autocast (the policy and the reference alike).
    trainer = DPOTrainer(model=load_model(model_dir, attn_implementation=attn),
                         ref_model=load_model(model_dir, attn_implementation=attn), args=args, train_dataset=_rows())
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    with HeadCalls() as counted:
        trainer.train()
    if calls is not None:
        calls.update(counted)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    delta = torch.cat([(p.detach() - before[k]).flatten() for k, p in trainer.model.named_parameters()])
    return [[e[key] for key in COMPARED] for e in logs], delta


def _attention_implementations() -> list[str]:
    found = ["sdpa", "flex_attention"]
    if importlib.util.find_spec("flash_attn") is not None:
        found.append("flash_attention_2")  # padding-free only: it refuses a shared prompt
    return found


@pytest.fixture(scope="module")
def truth(model_dir, tmp_path_factory):
    return _train(model_dir, tmp_path_factory.mktemp("truth"), "sdpa", bf16=False)


@pytest.mark.parametrize("attn", _attention_implementations())
def test_cuda_bf16_dpo_on_padded_padding_free_and_shared_prompt_rows_agree(model_dir, tmp_path, truth, attn):
    runs = {}
    for name, layout in LAYOUTS.items():
        if name == "shared_prompt" and attn.startswith("flash"):
            continue
        calls = Counter()
        runs[name] = _train(model_dir, tmp_path / name, attn, bf16=True, calls=calls, **layout)
        assert calls["forward"] == 6 and calls["backward"] == 6 and calls["mismatch"] == 0, (name, calls)
    truth_logs, truth_delta = truth
    padded_logs, padded_delta = runs.pop("padded")
    assert truth_logs[0][0] == pytest.approx(math.log(2), abs=1e-6) and truth_logs[-1][0] != truth_logs[0][0]
    for name, (logs, delta) in runs.items():
        for k, key in enumerate(COMPARED):
            err = max(abs(got[k] - want[k]) for got, want in zip(logs, truth_logs, strict=True))
            base = max(abs(got[k] - want[k]) for got, want in zip(padded_logs, truth_logs, strict=True))
            floor = 1e-3 * max(1.0, *(abs(want[k]) for want in truth_logs))
            assert err <= 3 * base + floor, (name, key, err, base)
        err, base_err = (delta - truth_delta).norm(), (padded_delta - truth_delta).norm()
        assert err <= 3 * base_err + 1e-3 * truth_delta.norm(), (name, float(err), float(base_err))


@pytest.mark.parametrize("name", ["padding_free", "shared_prompt"])
def test_cuda_fp32_packed_rows_on_flex_attention_equal_the_truth(model_dir, tmp_path, truth, name):
    logs, delta = _train(model_dir, tmp_path / name, "flex_attention", bf16=False, **LAYOUTS[name])
    truth_logs, truth_delta = truth
    for step, (got, want) in enumerate(zip(logs, truth_logs, strict=True)):
        for key, g, w in zip(COMPARED, got, want):
            assert abs(g - w) <= 1e-4 * max(1.0, abs(w)) + 1e-5, (name, step, key, g, w)
    assert (delta - truth_delta).norm() <= 1e-3 * truth_delta.norm()
