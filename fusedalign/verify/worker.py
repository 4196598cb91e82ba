"""What a process started by `fusedalign verify` runs: the real trainer, a few steps, its record.

    python -m fusedalign.verify.worker RUNS.json                    (one process)
    accelerate launch --config_file C.yaml -m fusedalign.verify.worker RUNS.json

RUNS.json is a list of runs written by the parent (`fusedalign.verify.plan`); each names
the trainer, the user's flags and verify's overrides (appended, so they win), and where
to write. The flags go through the same parser as `fusedalign <trainer>` and the trainer
is built by the same functions (`cli.training`), so what is checked is what the user
trains. Several runs share one launch: a launch costs more than a tiny run.

Each run writes, from the main process, `DIR/result.json` (every numeric value logged
per step, what really ran: world size, backend, wrapper, dtype) and the final model
(`DIR/model`, whole: `prepare_final_save` gathers ZeRO-3 and FSDP2 weights first); the
oracle also writes the initial model (`DIR/initial`) against which updates are measured.
A run may name a self-test injection (`inject.py`), applied around that run only.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

# Logged values that are not a function of the training maths.
NOT_COMPARED = ("epoch", "learning_rate", "step")
NOT_COMPARED_PARTS = ("runtime", "per_second", "time", "memory")


def step_history(log_history: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The numeric training values logged per step (the entries with a loss), timings left out."""
    steps = []
    for entry in log_history:
        if "loss" not in entry:
            continue
        steps.append({k: float(v) for k, v in entry.items() if isinstance(v, (int, float)) and k not in NOT_COMPARED
                      and not any(part in k for part in NOT_COMPARED_PARTS)})
    return steps


def _select_rows(dataset: Any, rows: int | None) -> Any:
    return dataset if rows is None or len(dataset) <= rows else dataset.select(range(rows))


def run_one(run: dict[str, Any]) -> None:
    from fusedalign.cli.help import dataclass_types
    from fusedalign.cli.parsing import parse
    from fusedalign.cli.training import build_trainer, load_splits
    from fusedalign.distributed import prepare_final_save
    from fusedalign.verify.inject import injected

    command, out_dir = run["trainer"], run["dir"]
    # The run's own directory, never the user's --output_dir (the trainer writes metrics.jsonl there).
    argv = [*run["argv"], *run["overrides"], "--output_dir", out_dir]
    script, args, model_args, _ = parse(command, dataclass_types(command), argv, announce=False)
    train, _ = load_splits(command, script, args)
    train = _select_rows(train, run.get("rows"))
    with injected(run.get("inject")):
        trainer = build_trainer(command, script, args, model_args, train, None)
        if run.get("save_initial"):
            trainer.save_model(os.path.join(out_dir, "initial"))
        trainer.train()
        prepare_final_save(trainer)
        trainer.save_model(os.path.join(out_dir, "model"))
    if trainer.is_world_process_zero():
        result = {
            "steps": step_history(trainer.state.log_history),
            "world_size": trainer.accelerator.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "wrapper": type(trainer.model_wrapped).__name__,
            "fused_head": bool(args.fused_head),
            "dtype": str(next(trainer.model.parameters()).dtype).replace("torch.", ""),
            "mixed_precision": str(trainer.accelerator.mixed_precision),
        }
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    trainer.accelerator.wait_for_everyone()


def main(argv: list[str] | None = None) -> int:
    from fusedalign.cli.noise import quiet_known_noise
    from fusedalign.distributed import setup_distributed, teardown_distributed
    from fusedalign.launch import check_launch

    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_known_noise()
    check_launch()
    setup_distributed()
    with open(argv[0]) as f:
        runs = json.load(f)
    for run in runs:
        if os.environ.get("RANK", "0") == "0":
            print(f"[verify] run {run['name']}", file=sys.stderr, flush=True)
        run_one(run)
    teardown_distributed()
    return 0


if __name__ == "__main__":
    from fusedalign.cli import _exit_code

    sys.exit(_exit_code(main()))
