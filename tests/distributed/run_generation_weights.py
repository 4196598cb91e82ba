"""Trains, generates under `generation_weights`, trains again: one process or under `accelerate launch`.

    python tests/distributed/run_generation_weights.py --spec spec.json --out DIR
    accelerate launch --config_file configs/accelerate/cpu/fsdp2.yaml tests/distributed/run_generation_weights.py ...

SFT (SGD, fp32, fixed data order) runs `steps` optimizer steps; after step `generate_at` a
callback decodes fixed prompts greedily inside `generation_weights` (counting the
all-gathers), saves the whole model of that step, and training goes on. DIR/result.json holds
the per-step losses, each rank's tokens, the all-gather counts (with the context and, under
ZeRO-3 and FSDP2, without it first), with `compile_step` in the spec each rank's tokens from
StaticDecode's compiled step on the same weights, and which wrapper ran;
DIR/step_model/ the weights generation saw, DIR/model/ the final weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from fusedalign.distributed import setup_distributed, teardown_distributed

PROMPTS = ["Beautiful is", "Flat is better than nested. Sparse is", "Now"]


GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base")


@contextlib.contextmanager
def counting_all_gathers(counter: list[int]):
    """Counts all-gathers: torch.distributed's (FSDP2's unshards) and DeepSpeed's (ZeRO-3's fetches,
    through the function its communication backend captured when it started)."""
    import torch.distributed as dist

    targets = [(dist, name) for name in GATHERS if hasattr(dist, name)]
    if "deepspeed" in sys.modules:
        from deepspeed.comm import comm as ds_comm

        if getattr(ds_comm, "cdb", None) is not None and getattr(ds_comm.cdb, "all_gather_function", None):
            targets.append((ds_comm.cdb, "all_gather_function"))
    real = [(owner, name, getattr(owner, name)) for owner, name in targets]

    def counted(fn):
        def call(*args, **kwargs):
            counter[0] += 1
            return fn(*args, **kwargs)
        return call

    for owner, name, fn in real:
        setattr(owner, name, counted(fn))
    try:
        yield
    finally:
        for owner, name, fn in real:
            setattr(owner, name, fn)


def backend_state(trainer, accelerator) -> dict:
    """What the backend's machinery looks like now: ZeRO-3's hooks and parameter shapes, FSDP2's shards."""
    from fusedalign.distributed import is_fsdp2, is_zero3
    from fusedalign.distributed.generation import _fsdp_states

    params = list(trainer.model.parameters())
    state = {"training": trainer.model.training}
    if is_zero3(accelerator):
        offload = trainer.model_wrapped.optimizer.parameter_offload
        state["zero3_hooks"] = len(offload.forward_hooks) + len(offload.backward_hooks)
        state["zero3_whole"] = all(p.numel() == p.ds_numel for p in params)
    if is_fsdp2(accelerator):
        groups = [g for m in _fsdp_states(trainer.model) for g in m._get_fsdp_state()._fsdp_param_groups]
        state["fsdp_groups"] = len(groups)
        state["fsdp_unsharded"] = sum(g.is_unsharded for g in groups)
    return state


def _greedy(max_new_tokens: int):
    from fusedalign.generation import HFGenerate
    from fusedalign.models import load_tokenizer

    tok = load_tokenizer("builtin:tiny-qwen2")
    gen = HFGenerate(max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     do_sample=False)
    return gen, [tok(p)["input_ids"] for p in PROMPTS]


def _compiled_greedy(max_new_tokens: int):
    from fusedalign.generation import StaticDecode
    from fusedalign.models import load_tokenizer

    tok = load_tokenizer("builtin:tiny-qwen2")
    return StaticDecode(max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        do_sample=False, compile_step=True)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    setup_distributed()
    with open(cli.spec) as f:
        spec = json.load(f)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch
    from accelerate.utils import gather_object
    from transformers import TrainerCallback

    from fusedalign.distributed import is_fsdp2, is_zero3, prepare_final_save
    from fusedalign.distributed.generation import _fsdp_states, generation_weights
    from tests.distributed.run_scenarios import build_trainer

    trainer = build_trainer({"trainer": "sft", "fused": True, **spec}, cli.out)
    prepare_final_save(trainer)
    gen, prompt_ids = _greedy(spec.get("max_new_tokens", 8))
    result: dict = {}

    class GenerateAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step != spec["generate_at"]:
                return
            acc = trainer.accelerator
            keys = [(i, 0) for i in range(len(prompt_ids))]
            if is_fsdp2(acc) or is_zero3(acc):
                # First without the context, for comparison: every decoding step gathers every module.
                naive = [0]
                with counting_all_gathers(naive), torch.no_grad():
                    gen.generate(acc.unwrap_model(trainer.model_wrapped), prompt_ids, keys)
                result["naive_all_gathers"] = naive[0]
            if is_fsdp2(acc):
                result["fsdp_modules"] = len(_fsdp_states(trainer.model))
            was_training = trainer.model.training
            result["before"] = backend_state(trainer, acc)
            gathers = [0]
            with counting_all_gathers(gathers), generation_weights(trainer.model_wrapped, acc) as whole:
                out = gen.generate(whole, prompt_ids, keys)
                result["inside"] = backend_state(trainer, acc)
            if spec.get("compile_step"):
                with generation_weights(trainer.model_wrapped, acc) as whole:
                    # StaticDecode's compiled step (eager steps on the CPU) on the same weights.
                    compiled = _compiled_greedy(spec.get("max_new_tokens", 8))
                    result["compiled_tokens"] = gather_object(
                        [compiled.generate(whole, prompt_ids, keys).completion_ids])
                    result["compiled_call"] = {**compiled.last_call, "unique_graphs": _compiled_graphs()}
            result["after"] = backend_state(trainer, acc)
            result["tokens"] = gather_object([out.completion_ids])
            result["all_gathers"] = gathers[0]
            result["restored_train_mode"] = trainer.model.training == was_training
            result["parameters"] = len(list(trainer.model.parameters()))
            trainer.save_model(os.path.join(cli.out, "step_model"))

    trainer.add_callback(GenerateAt())
    trainer.train()
    result.update(
        losses=[e["loss"] for e in trainer.state.log_history if "loss" in e],
        world_size=trainer.accelerator.num_processes,
        distributed_type=str(trainer.accelerator.distributed_type),
        wrapper=type(trainer.model_wrapped).__name__,
    )
    trainer.save_model(os.path.join(cli.out, "model"))
    if trainer.is_world_process_zero():
        with open(os.path.join(cli.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    trainer.accelerator.wait_for_everyone()
    teardown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
