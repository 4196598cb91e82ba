"""Trains a student against a frozen teacher through `token_divergence`: one process or under `accelerate launch`.

    python tests/distributed/run_distill_head.py --spec specs.json --out DIR
    accelerate launch --config_file configs/accelerate/cpu/zero3.yaml tests/distributed/run_distill_head.py ...

The distillation trainer needs on-policy generation, which is built elsewhere; this runner
isolates what the loss needs from the backend. The SFT trainer's step (its fixed data, its
global token count, its typed metrics) with the loss swapped: each scenario trains a few SGD
steps (fp32, fixed order) on the embedded prompt-completion data, the loss being the
generalised JSD of the completion tokens between the student (the trainer's model, prepared by
the backend) and a teacher of another architecture prepared as the backend prepares a frozen
model (`distributed.prepare_reference_model`). DIR/<name>/result.json holds the per-step
losses and entropies and which wrapper ran; DIR/<name>/model/ the final weights.
"""

from __future__ import annotations

import os
import sys

from run_scenarios import partitioned, run_all, save_result  # a sibling: this script's folder is on the path


def build_trainer(spec: dict, out_dir: str):
    from fusedalign.configs import SFTConfig
    from fusedalign.data import load_dataset_any
    from fusedalign.distill_head import token_divergence
    from fusedalign.distributed import prepare_reference_model
    from fusedalign.head import IGNORE_INDEX
    from fusedalign.losses.distillation import distillation_batch_loss
    from fusedalign.models import load_model
    from fusedalign.trainers.sft import SFTTrainer

    args = SFTConfig(
        output_dir=out_dir, max_steps=spec.get("steps", 3), learning_rate=spec.get("lr", 0.5), optim="sgd",
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        per_device_train_batch_size=spec["per_device_batch"], gradient_accumulation_steps=spec.get("grad_accum", 1),
        train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", seed=0, data_seed=0,
        fused_head=spec["fused"], report_to="none", max_length=48, completion_only_loss=True,
    )
    # Loaded after the arguments exist: under ZeRO-3 they make from_pretrained load it partitioned.
    teacher = load_model(spec.get("teacher", "builtin:tiny-gemma2"))
    if spec.get("teacher_softcap"):  # a cap the tiny model's logits reach, so that folding it in matters
        teacher.config.final_logit_softcapping = float(spec["teacher_softcap"])
    peft_config = None
    if spec.get("lora_head"):
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                                 target_modules=["q_proj", "lm_head"], init_lora_weights=False)

    class DistillOnData(SFTTrainer):
        def loss_and_metrics(self, model, inputs, mode):
            labels = self.labels(inputs)
            out = token_divergence(model, self.teacher, self.model_inputs(inputs), labels, fused=self.args.fused_head,
                                   beta=spec.get("beta", 0.5), temperature=spec.get("temperature", 1.0))
            return distillation_batch_loss(out.divergence, labels != IGNORE_INDEX, out.entropy)

    train = load_dataset_any("builtin:zen", "standard_prompt_completion", split="train")
    trainer = DistillOnData(model=load_model(spec.get("model", "builtin:tiny-qwen2")), args=args, train_dataset=train,
                            peft_config=peft_config)
    trainer.teacher = prepare_reference_model(teacher, trainer.accelerator)
    # How the backend holds the teacher before training: ZeRO-3 partitions (ds_numel), FSDP2 shards (DTensor).
    trainer.teacher_partitioned = partitioned(trainer.teacher)
    return trainer


def run(spec: dict, out_root: str) -> None:
    out_dir = os.path.join(out_root, spec["name"])
    trainer = build_trainer(spec, out_dir)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "losses": [entry["loss"] for entry in logged],
        "entropy": [entry["entropy"] for entry in logged],
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapper": type(trainer.model_wrapped).__name__,
        "teacher_wrapper": type(trainer.teacher).__name__,
        "teacher_partitioned": trainer.teacher_partitioned,
    }
    save_result(trainer, out_dir, result)


if __name__ == "__main__":
    sys.exit(run_all(run))
