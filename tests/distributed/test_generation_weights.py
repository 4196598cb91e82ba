"""Generation under `generation_weights` on DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 CPU processes, gloo).

One launch per backend (tests/distributed/run_generation_weights.py): 2 SGD steps of SFT,
greedy decoding of fixed prompts (8 new tokens) inside `generation_weights`, the step's whole
weights saved, 2 more steps. Checked against a single process doing the same:
- the tokens (both ranks) equal a single-process greedy decoding of the saved weights, which
  differ from the initial weights' tokens (generation sees the trained weights, not stale or
  empty shards), and so do StaticDecode's with its step compiled (`compile_step`) on ZeRO-3 and
  FSDP2, whose weights are sharded outside the context;
- training after generation gives the same per-step losses and final weights (the hooks,
  shards and parameter tracking were put back);
- on FSDP2, about one all-gather per module during the generation, not one per decoded token
  (the same generation without the context, counted first, gathers many times more).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.parity import (
    BACKENDS,
    CPU_CONFIGS,
    EXPECTED_WRAPPER,
    ROOT,
    RTOL,
    _free_port,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RUNNER = ROOT / "tests" / "distributed" / "run_generation_weights.py"
# Where StaticDecode's compiled step also decodes inside the context: the backends whose weights
# are sharded outside it (a compiled step that captured a shard, or a gathered parameter ZeRO-3
# or FSDP2 frees after, would decode other tokens). DDP and ZeRO-2 hold whole weights throughout.
COMPILED = ("zero3", "fsdp2")
SPEC = {"steps": 4, "generate_at": 2, "lr": 0.02, "max_new_tokens": 8, "fused": True}


def _launch(out: Path, backend: str | None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    spec = {**SPEC, "per_device_batch": 4 if backend is None else 2,  # the same global batch of 4
            "compile_step": backend in COMPILED}
    (out / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(RUNNER)]
    if backend is not None:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIGS / f"{backend}.yaml"),
               "--main_process_port", str(_free_port()), str(RUNNER)]
    cmd += ["--spec", str(out / "spec.json"), "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generation_weights")
    done: dict = {}

    def get(backend: str | None) -> tuple[Path, dict]:
        if backend not in done:
            out = root / (backend or "single")
            done[backend] = (out, _launch(out, backend))
        return done[backend]

    return get


def _model_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _greedy_tokens(model_dir: str) -> list[list[int]]:
    from fusedalign.models import load_model
    from tests.distributed.run_generation_weights import PROMPTS, _greedy

    gen, prompt_ids = _greedy(SPEC["max_new_tokens"])
    model = load_model(model_dir).eval()
    return gen.generate(model, prompt_ids, [(i, 0) for i in range(len(PROMPTS))]).completion_ids


def test_single_process_reference(runs):
    out, res = runs(None)
    initial = _model_weights(ROOT / "fusedalign" / "resources" / "models" / "tiny-qwen2")
    moved = [k for k, v in _model_weights(out / "step_model").items() if not torch.allclose(v, initial[k])]
    assert moved, "two training steps changed no weight; the comparison would be vacuous"
    (tokens,) = res["tokens"]
    assert tokens == _greedy_tokens(str(out / "step_model"))
    assert tokens != _greedy_tokens("builtin:tiny-qwen2"), "the trained weights decode as the initial ones"
    assert [len(t) for t in tokens] == [SPEC["max_new_tokens"]] * len(tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_generation_sees_whole_current_weights_and_training_goes_on(runs, backend):
    out, res = runs(backend)
    base_out, base = runs(None)
    dist_type, wrapper = EXPECTED_WRAPPER[backend]
    assert res["world_size"] == 2 and res["distributed_type"] == dist_type, res
    if wrapper:
        assert res["wrapper"] == wrapper, res
    # Both ranks decoded the single process's tokens, which are those of the saved step weights.
    rank0, rank1 = res["tokens"]
    assert rank0 == rank1 == base["tokens"][0]
    assert rank0 == _greedy_tokens(str(out / "step_model"))
    # StaticDecode's compiled step on the same whole weights: the same tokens, compiled (not a
    # fallback to eager code or to generate).
    if backend in COMPILED:
        assert res["compiled_tokens"] == [rank0, rank0]
        assert res["compiled_call"]["path"] == "static" and res["compiled_call"]["compiled"] is True
        assert res["compiled_call"]["unique_graphs"] >= 1, res["compiled_call"]
    else:
        assert "compiled_tokens" not in res
    # The backend's state inside the block, and put back after it.
    assert res["restored_train_mode"] and res["inside"]["training"] is False and res["after"]["training"] is True
    if backend == "zero3":
        assert res["inside"]["zero3_hooks"] == 0 and res["inside"]["zero3_whole"]
        assert res["after"]["zero3_hooks"] == res["before"]["zero3_hooks"] > 0
        assert not res["after"]["zero3_whole"]  # partitioned again
    if backend == "fsdp2":
        groups = res["inside"]["fsdp_groups"]
        assert res["inside"]["fsdp_unsharded"] == groups and res["after"]["fsdp_unsharded"] == 0
        assert 1 <= res["all_gathers"] <= groups, res
        assert res["naive_all_gathers"] >= 4 * res["all_gathers"], res  # per token without the context
    if backend in ("ddp", "zero2"):
        assert res["all_gathers"] == 0
    # Training right after generation: same losses and final weights as one process.
    assert len(res["losses"]) == len(base["losses"]) == SPEC["steps"]
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(base["losses"]), rtol=RTOL, atol=1e-7)
    got, want = _model_weights(out / "model"), _model_weights(base_out / "model")
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=RTOL, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
