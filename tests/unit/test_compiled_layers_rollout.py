"""`--compile_layers` in a trainer that generates: the rollout runs the decoder layers eager, so
torch's recompile limit is left to training's forwards (before, a 24-layer model's rollout spent
it on its cache states, decoding shapes and layers' cache indices, and training ran eager)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from fusedalign.configs import GRPOConfig
from fusedalign.data import load_dataset_any
from fusedalign.models import load_model
from fusedalign.trainers.grpo import GRPOTrainer
from tests.grpo_replay import token_sum_reward


def _graphs_in_rollouts_and_in_all(tmp_path, **compile_args) -> tuple[list[int], int]:
    """Two GRPO steps of the tiny model with compiled layers: the graphs dynamo compiled during each
    rollout, and in the whole run."""
    torch._dynamo.reset()  # the limit counts every earlier graph of the layers' code in this process
    prompts = load_dataset_any("builtin:zen", "standard_prompt_only").select(range(8))
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=2, learning_rate=0.1, optim="sgd", per_device_train_batch_size=8,
        num_generations=4, max_completion_length=8, beta=0.04, logging_steps=1, save_strategy="no", seed=0,
        report_to="none", disable_tqdm=True, **compile_args,
    )
    assert args.compile_layers
    torch.manual_seed(0)
    trainer = GRPOTrainer(load_model("builtin:tiny-qwen2"), reward_funcs=token_sum_reward, args=args,
                          train_dataset=prompts)
    generate, during = trainer.generator.generate, []

    def counted(*a, **k):
        before = counters["stats"]["unique_graphs"]
        out = generate(*a, **k)
        during.append(counters["stats"]["unique_graphs"] - before)
        return out

    trainer.rollout.generator.generate = counted
    start = counters["stats"]["unique_graphs"]
    trainer.train()
    return during, counters["stats"]["unique_graphs"] - start


def test_grpo_rollout_compiles_nothing_and_training_compiles_within_the_limit(tmp_path):
    during, graphs = _graphs_in_rollouts_and_in_all(tmp_path, torch_compile_backend="eager")  # cheap to compile
    assert during == [0, 0]  # one rollout a step, no graph compiled in either
    # forwards with and without gradients, each at its first length, then with the length dynamic: 4
    assert 1 <= graphs < torch._dynamo.config.recompile_limit, graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grpo_rollout_on_gpu_compiles_nothing_and_training_compiles_with_inductor(tmp_path):
    """On CUDA the rollout is StaticDecode's captured step with the Triton kernels, around eager layers."""
    during, graphs = _graphs_in_rollouts_and_in_all(tmp_path, compile_layers=True)
    assert during == [0, 0]
    assert 1 <= graphs < torch._dynamo.config.recompile_limit, graphs
