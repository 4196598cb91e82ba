"""Runs training scenarios for the parity tests: single process or under `accelerate launch`.

    python tests/distributed/run_scenarios.py --spec specs.json --out DIR
    accelerate launch --config_file configs/accelerate/cpu/zero3.yaml tests/distributed/run_scenarios.py ...

`specs.json` is a list of scenarios; each trains a few optimizer steps with SGD in fp32
on the embedded data in a fixed order, then writes `DIR/<name>/result.json` (per-step
losses, eval metrics) and the final model (`DIR/<name>/model/model.safetensors`).
Several scenarios run one after another in the same processes, which saves the
start-up cost of a launch per scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from fusedalign.distributed import setup_distributed, teardown_distributed


def _packed(spec: dict) -> dict:
    """DPO/KTO batch layout flags: padding_free, share_prompt, max_tokens_per_batch."""
    return dict(padding_free=spec.get("padding_free", False), share_prompt=spec.get("share_prompt", False),
                max_tokens_per_batch=spec.get("max_tokens_per_batch"))


def budget_plan(spec: dict, world: int) -> list[list[int]]:
    """The token-budget micro-batches of a DPO `spec` with `train_rows` and `max_tokens_per_batch`,
    as the trainer plans them (sequential order) over `world` processes."""
    from fusedalign.data import load_dataset_any
    from fusedalign.data.preference_batches import dpo_row_tokens
    from fusedalign.data.samplers import TokenBudgetBatchSampler
    from fusedalign.data.splits import prepare_split
    from fusedalign.models import load_tokenizer

    rows = load_dataset_any("builtin:zen", "standard_preference", split="train").select(range(spec["train_rows"]))
    rows = prepare_split("dpo", rows, load_tokenizer(spec.get("model", "builtin:tiny-qwen2")), "train",
                         max_length=spec.get("max_length", 64), max_prompt_length=32, truncation_mode="keep_start")
    return TokenBudgetBatchSampler([dpo_row_tokens(r, spec.get("share_prompt", False)) for r in rows],
                                   spec["max_tokens_per_batch"], num_processes=world, shuffle=False).batches


def _accumulation(spec: dict) -> int:
    """`grad_accum`, or "epoch" (DPO with a token budget): every micro-batch of the plan in one
    optimizer step, so that micro-batches holding different numbers of pairs train like one
    padded batch of the same `train_rows` pairs."""
    accumulation = spec.get("grad_accum", 1)
    if accumulation != "epoch":
        return accumulation
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return len(budget_plan(spec, world)) // world


def build_trainer(spec: dict, out_dir: str):
    from fusedalign.data import load_dataset_any
    from fusedalign.models import load_model

    trainer_name = spec.get("trainer", "dpo")
    common = dict(
        output_dir=out_dir, max_steps=spec.get("steps", 3), learning_rate=spec.get("lr", 0.1), optim="sgd",
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        per_device_train_batch_size=spec["per_device_batch"],
        per_device_eval_batch_size=spec.get("eval_batch", spec["per_device_batch"]),
        gradient_accumulation_steps=_accumulation(spec), train_sampling_strategy="sequential",
        logging_steps=1, save_strategy="steps" if spec.get("save_steps") else "no", save_steps=spec.get("save_steps", 500),
        seed=0, data_seed=0, fused_head=spec["fused"], report_to="none",
        dataloader_drop_last=False, max_length=spec.get("max_length", 64),
        compile_layers=spec.get("compile", False), gradient_checkpointing=spec.get("gradient_checkpointing", False),
        gradient_checkpointing_kwargs={"use_reentrant": False} if spec.get("gradient_checkpointing") else None,
        tiled_mlp_tokens=spec.get("tiled_mlp_tokens", 0),
    )
    peft_config = None
    if spec.get("peft"):
        from peft import LoraConfig

        peft_config = LoraConfig(
            task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
            target_modules=spec.get("lora_target_modules", ["q_proj", "v_proj"]),
            init_lora_weights=spec.get("init_lora_weights", True),
        )
    if trainer_name == "dpo":
        from fusedalign.configs import DPOConfig
        from fusedalign.trainers.dpo import DPOTrainer

        args = DPOConfig(
            **common, beta=spec.get("beta", 0.5), loss_type=spec.get("loss_type", ["sigmoid"]),
            max_prompt_length=32, precompute_ref_log_probs=spec.get("precompute", False), **_packed(spec),
            ld_alpha=spec.get("ld_alpha"), f_divergence_type=spec.get("f_divergence_type", "reverse_kl"),
            use_weighting=spec.get("use_weighting", False),
        )
        config = spec.get("dataset_config", "standard_preference")
        trainer_cls = DPOTrainer
    elif trainer_name == "sft":
        from fusedalign.configs import SFTConfig
        from fusedalign.trainers.sft import SFTTrainer

        args = SFTConfig(**common, packing=spec.get("packing", False), padding_free=spec.get("padding_free", False))
        config = spec.get("dataset_config", "standard_language_modeling")
        trainer_cls = SFTTrainer
    elif trainer_name == "kto":
        from fusedalign.configs import KTOConfig
        from fusedalign.trainers.kto import KTOTrainer

        # KL pairs are fixed per dataset row (seed) and z0 is taken over the whole optimizer
        # step, so any split of the global batch (ranks x accumulation x per-device batch)
        # trains the same. A different reference (e.g. builtin:tiny-llama, same tokenizer)
        # makes the log-ratios, and so z0, non-zero from the first step.
        loss_type = spec.get("loss_type", "kto")
        args = KTOConfig(
            **common, beta=spec.get("beta", 0.5), loss_type=loss_type[0] if isinstance(loss_type, list) else loss_type,
            max_prompt_length=32, precompute_ref_log_probs=spec.get("precompute", False),
            ref_model_name_or_path=spec.get("ref_model"), unpair_preference=spec.get("unpair_preference", False),
            **_packed(spec),
        )
        config = spec.get("dataset_config", "standard_unpaired_preference")
        trainer_cls = KTOTrainer
    elif trainer_name in ("grpo", "rloo"):
        return _grpo_trainer(spec, common, peft_config)
    elif trainer_name == "distillation":
        return _distillation_trainer(spec, common, peft_config)
    else:
        raise ValueError(f"unknown trainer {trainer_name}")
    train = load_dataset_any("builtin:zen", config, split="train")
    if spec.get("train_rows"):
        train = train.select(range(spec["train_rows"]))
    evaluate = load_dataset_any("builtin:zen", config, split="test") if spec.get("evaluate") else None
    if evaluate is not None and spec.get("eval_rows"):
        evaluate = evaluate.select(range(spec["eval_rows"]))
    model = load_model(spec.get("model", "builtin:tiny-qwen2"))
    return trainer_cls(model=model, args=args, train_dataset=train, eval_dataset=evaluate, peft_config=peft_config)


def _grpo_trainer(spec: dict, common: dict, peft_config):
    """GRPO or RLOO on replayed completions (tests/grpo_replay.py): the training maths alone, the same on
    every backend."""
    from fusedalign.configs import GRPOConfig, RLOOConfig
    from fusedalign.data import load_dataset_any
    from fusedalign.models import load_model, load_tokenizer
    from fusedalign.trainers.grpo import GRPOTrainer
    from fusedalign.trainers.rloo import RLOOTrainer

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo
    from tests.grpo_replay import token_sum_reward, uneven_replay

    generations = spec.get("num_generations", 4)
    if spec["trainer"] == "rloo":
        config, trainer_cls = RLOOConfig, RLOOTrainer
        own = dict(normalize_advantages=spec.get("normalize_advantages", False),
                   reward_clip_range=spec.get("reward_clip_range"), epsilon_high=spec.get("epsilon_high"))
    else:
        config, trainer_cls = GRPOConfig, GRPOTrainer
        own = dict(loss_type=spec.get("loss_type", "dapo"), top_entropy_quantile=spec.get("top_entropy_quantile", 1.0))
    args = config(
        **common, num_generations=generations, max_completion_length=12, beta=spec.get("beta", 0.0),
        num_iterations=spec.get("num_iterations", 1), shuffle_dataset=False,
        mask_truncated_completions=spec.get("mask_truncated_completions", False),
        keyed_sampling=spec.get("keyed", False), generation_backend=spec.get("generation_backend", "auto"), **own,
        fused_sampling=spec.get("fused_sampling", False), fuse_projections=spec.get("fuse_projections", False),
        generation_max_rows=spec.get("generation_max_rows", 0), **_packed(spec),
    )
    prompts = load_dataset_any("builtin:zen", "standard_prompt_only", split="train").select(range(32))
    replay = uneven_replay(32, generations, load_tokenizer("builtin:tiny-qwen2").eos_token_id,
                           truncate_every=spec.get("truncate_every", 4), truncate_rows=spec.get("truncate_rows", ()))
    # A reward model beside the token sum: a path, loaded by the trainer as a user's would be.
    from tests.reward_model import REWARD_MODEL_ENV

    rewards = [token_sum_reward, os.environ[REWARD_MODEL_ENV]] if spec.get("reward_model") else token_sum_reward
    # keyed: real generation (generation_weights on the backend) with draws that do not depend on the split.
    trainer = trainer_cls(load_model(spec.get("model", "builtin:tiny-qwen2")), reward_funcs=rewards, args=args,
                          train_dataset=prompts, peft_config=peft_config,
                          generator=None if spec.get("keyed") else _RecordedKeys(replay, common["output_dir"]))
    if spec.get("eos_every"):  # StaticDecode's loop: every n-th token id ends a completion, so rows end early,
        trainer.generator.eos_token_ids = list(range(0, trainer.model.config.vocab_size, spec["eos_every"]))
        trainer.generator.check_every = 2  # and a check every 2 tokens finds them (compaction within 12 tokens)
    return trainer


def _distillation_trainer(spec: dict, common: dict, peft_config):
    """Distillation on replayed completions (one a prompt): the student's and the teacher's heads in
    the loss, the same completions on every backend."""
    from fusedalign.configs import DistillationConfig
    from fusedalign.data import load_dataset_any
    from fusedalign.models import load_model, load_tokenizer
    from fusedalign.trainers.distillation import DistillationTrainer

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo
    from tests.grpo_replay import uneven_replay

    args = DistillationConfig(**common, max_completion_length=12, beta=spec.get("beta", 1.0),
                              temperature=spec.get("temperature", 1.0), shuffle_dataset=False,
                              teacher_model_name_or_path=spec.get("teacher", "builtin:tiny-zen-teacher"),
                              teacher_model_init_kwargs=spec.get("teacher_kwargs"), **_packed(spec))
    prompts = load_dataset_any("builtin:zen", "standard_prompt_only", split="train").select(range(32))
    replay = uneven_replay(32, 1, load_tokenizer("builtin:tiny-qwen2").eos_token_id)
    return DistillationTrainer(load_model(spec.get("model", "builtin:tiny-qwen2")), args=args, train_dataset=prompts,
                               peft_config=peft_config, generator=_RecordedKeys(replay, common["output_dir"]))


class _RecordedKeys:
    """A generator that writes the (dataset row, generation) keys of every call on this rank to
    `<out>/keys.rank<R>.jsonl`, one line a generation, so that the tests can check which
    completions each rank held (a group split over ranks, a rank with only masked rows)."""

    def __init__(self, generator, out_dir: str):
        self.generator, self.path = generator, os.path.join(out_dir, f"keys.rank{os.environ.get('RANK', '0')}.jsonl")
        os.makedirs(out_dir, exist_ok=True)
        open(self.path, "w").close()

    def generate(self, model, prompt_ids, row_keys, *, step=0):
        with open(self.path, "a") as f:
            f.write(json.dumps([list(k) for k in row_keys]) + "\n")
        return self.generator.generate(model, prompt_ids, row_keys, step=step)


def run(spec: dict, out_root: str) -> None:
    out_dir = os.path.join(out_root, spec["name"])
    if spec.get("resume_at"):
        # A run stopped after checkpoint-K, then a new process group resuming from it.
        first = build_trainer({**spec, "steps": spec["resume_at"], "save_steps": spec["resume_at"]}, out_dir)
        first.train()
        del first
    trainer = build_trainer(spec, out_dir)
    from torch._dynamo.utils import counters

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo
    from tests.head_calls import HeadCalls
    from tests.micro_batches import record_micro_batches

    graphs_before = counters["stats"]["unique_graphs"]
    # Before training: a precomputed reference is let go after its pass, and ZeRO-3 keeps small
    # parameters whole once they have been used.
    frozen = frozen_model(trainer)
    frozen_partitioned = None if frozen is None else partitioned(frozen)
    rewards_partitioned = [partitioned(model) for model in reward_models(trainer)]
    micro_batches = record_micro_batches(trainer)
    tile_checkpoints = _count_tile_checkpoints()
    head = HeadCalls().start()
    resume = os.path.join(out_dir, f"checkpoint-{spec['resume_at']}") if spec.get("resume_at") else None
    trainer.train(resume_from_checkpoint=resume)
    head_calls = head.stop()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "losses": losses,
        # Every logged training value per step, for trainers whose parity covers more than the loss.
        "history": [{k: v for k, v in entry.items() if isinstance(v, (int, float))}
                    for entry in trainer.state.log_history if "loss" in entry],
        "world_size": trainer.accelerator.num_processes,
        # What really ran: the parity tests check it, since accelerate can silently fall
        # back to DDP on CPU.
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapper": type(trainer.model_wrapped).__name__,
        "model_class": type(trainer.model).__name__,
        # The separate frozen model (reference or teacher), if any, and whether the backend split it over the ranks.
        "frozen_partitioned": frozen_partitioned,
        "reward_models_partitioned": rewards_partitioned,  # the same for each reward model
        # Whether the layers were to be compiled, and the graphs dynamo compiled while training.
        "compile_layers": trainer.args.compile_layers,
        "compiled_graphs": counters["stats"]["unique_graphs"] - graphs_before,
        # How the policy's head ran in training (ops/loss_aware.py): forms its gradient in
        # the forward where the trainer declares its loss (DPO, fused, per-pair loss types).
        "loss_aware_expected": bool(getattr(trainer, "_loss_aware", lambda mode: False)("train")),
        "head_calls": {key: head_calls[key] for key in ("forward", "backward", "mismatch", "over_budget")},
        # GRPO: the generator that ran, and how its last call went (StaticDecode: its own loop or generate).
        "generator": type(getattr(trainer, "generator", None)).__name__,
        "generator_last_call": getattr(getattr(trainer, "generator", None), "last_call", None),
        # The types of the prepared micro-batches the loss read (padded or packed rows), on this rank.
        "batch_types": sorted({type(batch).__name__ for batch in micro_batches}),
        # --tiled_mlp_tokens: the MLPs tiled in the policy and the frozen model, and the tiles run under
        # their own checkpoint (with gradients) on this rank.
        "tiled_mlps": [_tiled_mlps(trainer.model), _tiled_mlps(frozen)],
        "tiled_mlps_with_adapters": _tiled_mlps(trainer.model, with_adapters=True),
        "tile_checkpoints": tile_checkpoints[0],
    }
    # Per rank: the forwards the loss ran (a micro-batch in parts runs one per part), and the most tokens
    # one of them held (packed rows).
    import torch

    tokens = [batch.forward_tokens() if hasattr(batch, "forward_tokens") else int(batch["input_ids"].numel())
              for batch in micro_batches]  # typed batches; SFT's are dicts
    # Packed rows in which completions share their prompt (a segment with a parent).
    shared = sum(1 for batch in micro_batches
                 if getattr(getattr(batch, "rows", None), "parent_ids", None) is not None
                 and bool((batch.rows.parent_ids >= 0).any()))
    counts = [len(micro_batches), max(tokens, default=0), shared]
    gathered = trainer.accelerator.gather(torch.tensor([counts], device=trainer.accelerator.device)).tolist()
    result["forwards_per_rank"] = [row[0] for row in gathered]
    result["largest_forward_per_rank"] = [row[1] for row in gathered]
    result["shared_prompt_forwards_per_rank"] = [row[2] for row in gathered]
    if spec.get("evaluate"):
        metrics = trainer.evaluate()
        result["eval"] = {k: v for k, v in metrics.items() if isinstance(v, float) and "runtime" not in k and "per_second" not in k}
    save_result(trainer, out_dir, result)


def _count_tile_checkpoints() -> list[int]:
    """Counts the checkpointed tiles of fusedalign/tiled_mlp.py from now on, for this scenario: each
    scenario's counter replaces the last one's (never wraps it)."""
    import fusedalign.tiled_mlp as tiled_mlp

    calls, inner = [0], getattr(tiled_mlp.checkpoint, "__wrapped__", tiled_mlp.checkpoint)

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    counted.__wrapped__ = inner
    tiled_mlp.checkpoint = counted
    return calls


def _tiled_mlps(model, with_adapters: bool = False) -> int:
    """The tiled MLPs in `model`; with `with_adapters`, those holding a LoRA adapter."""
    if model is None:
        return 0
    return sum(1 for m in model.modules() if getattr(m, "_fusedalign_tile_tokens", None)
               and (not with_adapters or any("lora_A" in name for name, _ in m.named_modules())))


def frozen_model(trainer):
    """The trainer's separate frozen model: a distillation teacher or a reference model; None if it has none."""
    teacher = getattr(trainer, "teacher_model", None)
    if teacher is not None:
        return teacher
    reference = getattr(trainer, "reference", None)
    return getattr(reference, "model", None)


def reward_models(trainer) -> list:
    """The models of GRPO's and RLOO's model-based reward functions (none for other trainers)."""
    funcs = getattr(getattr(getattr(trainer, "rollout", None), "reward_funcs", None), "funcs", ())
    return [func.model for func in funcs if hasattr(func, "prepare")]


def partitioned(model) -> bool:
    """Whether the backend manages every parameter and this rank holds only a part of the model: ZeRO-3
    (ds_numel) or FSDP2 (DTensor shards of dim 0; a parameter of one row lies all on rank 0, so the part
    is measured over the whole model)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    if params and all(hasattr(p, "ds_numel") for p in params):
        held, whole = sum(p.numel() for p in params), sum(p.ds_numel for p in params)
    elif params and all(isinstance(p, DTensor) for p in params):
        held, whole = sum(p.to_local().numel() for p in params), sum(p.numel() for p in params)
    else:
        return False
    return held < whole


def save_result(trainer, out_dir: str, result: dict) -> None:
    """The final model (whole, on any backend) and, from rank 0, `result.json`, for the test to compare."""
    from fusedalign.distributed import prepare_final_save

    prepare_final_save(trainer)
    trainer.save_model(os.path.join(out_dir, "model"))
    if trainer.is_world_process_zero():
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    trainer.accelerator.wait_for_everyone()


def run_all(run_one) -> int:
    """A runner's main: `run_one(spec, out_root)` for every spec of --spec, in one process group."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    setup_distributed()
    with open(cli.spec) as f:
        specs = json.load(f)
    for spec in specs:
        run_one(spec, cli.out)
    teardown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(run_all(run))
