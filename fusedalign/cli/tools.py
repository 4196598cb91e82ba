"""`fusedalign plot|merge|consolidate`: commands on the outputs of a run (`verify`: fusedalign.verify)."""

from __future__ import annotations

import os
import sys

from fusedalign.errors import CLIError

HELP_FLAGS = ("-h", "--help")

PLOT_USAGE = "usage: fusedalign plot OUTPUT_DIR"
MERGE_USAGE = "usage: fusedalign merge ADAPTER_DIR OUTPUT_DIR [--base_model NAME_OR_PATH]"
CONSOLIDATE_USAGE = "usage: fusedalign consolidate CHECKPOINT_DIR [OUTPUT_DIR]"
HELP = {
    "plot": f"""{PLOT_USAGE}

Draws the training curves of a run, OUTPUT_DIR/metrics.jsonl, into
OUTPUT_DIR/training_curves.png and prints the path of the PNG.""",
    "merge": f"""{MERGE_USAGE}

Merges the LoRA adapter of a --use_peft run (ADAPTER_DIR, its --output_dir) into
its base model and saves the full model and tokenizer in OUTPUT_DIR, a new or empty
directory (one that holds files is refused; `--output_dir OUTPUT_DIR` names it too).
  --base_model NAME_OR_PATH  the base model (default: the one adapter_config.json names)""",
    "consolidate": f"""{CONSOLIDATE_USAGE}

Writes the whole model of a sharded (FSDP2) checkpoint as safetensors, loadable with
AutoModelForCausalLM.from_pretrained, into OUTPUT_DIR (default: CHECKPOINT_DIR itself).""",
}


def _asks_for_help(name: str, argv: list[str]) -> bool:
    """Prints the command's help when asked for it (`-h`/`--help`), as a training command does."""
    if not any(flag in argv for flag in HELP_FLAGS):
        return False
    print(HELP[name])
    return True


def run_plot(argv: list[str]) -> int:
    if _asks_for_help("plot", argv):
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        raise CLIError(PLOT_USAGE)
    from fusedalign.plot import plot_run

    print(plot_run(argv[0]))
    return 0


def _take_option(argv: list[str], name: str, usage: str) -> tuple[str | None, list[str]]:
    if name not in argv:
        return None, argv
    i = argv.index(name)
    if i + 1 >= len(argv):
        raise CLIError(usage)
    return argv[i + 1], argv[:i] + argv[i + 2 :]


def run_merge(argv: list[str]) -> int:
    """`fusedalign merge ADAPTER_DIR OUTPUT_DIR [--base_model NAME]`: a LoRA adapter folded into its base."""
    if _asks_for_help("merge", argv):
        return 0
    base, argv = _take_option(argv, "--base_model", MERGE_USAGE)
    output_flag, argv = _take_option(argv, "--output_dir", MERGE_USAGE)  # what a training command calls it
    argv += [output_flag] if output_flag is not None else []
    if len(argv) != 2 or any(a.startswith("-") for a in argv):
        raise CLIError(MERGE_USAGE)
    adapter_dir, output_dir = argv
    if not os.path.isdir(adapter_dir):
        raise CLIError(f"ADAPTER_DIR {adapter_dir} does not exist; expected the output_dir of a run with --use_peft.")
    if not os.path.isfile(os.path.join(adapter_dir, "adapter_config.json")):
        raise CLIError(f"{adapter_dir} is not a PEFT adapter directory (no adapter_config.json); "
                       "expected the output_dir of a run with --use_peft.")
    if os.path.isdir(output_dir) and os.listdir(output_dir):
        held = sorted(os.listdir(output_dir))
        listed = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise CLIError(f"OUTPUT_DIR {output_dir} already holds files ({listed}); the merged model would mix with "
                       "them: give a new or empty directory.")
    from peft import PeftConfig, PeftModel

    from fusedalign.models import load_model, load_tokenizer

    recorded = base is None
    base = base or PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path
    try:
        base_model = load_model(base)
    except Exception as err:  # a hub id not reachable, a path that is not here: one line, with the way out
        if not recorded:
            raise
        raise CLIError(f"the base model {base!r} that {adapter_dir}/adapter_config.json names cannot be loaded "
                       f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); if it is a directory "
                       "(a relative path is read from where the adapter was trained), pass --base_model PATH.") from None
    model = PeftModel.from_pretrained(base_model, adapter_dir).merge_and_unload()
    has_tokenizer = any(os.path.isfile(os.path.join(adapter_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = load_tokenizer(adapter_dir if has_tokenizer else base)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    print(f"[fusedalign] the adapter in {adapter_dir} merged into a copy of its base model {base} (which is "
          f"unchanged); the full model and tokenizer saved in {output_dir}", file=sys.stderr)
    return 0


def run_consolidate(argv: list[str]) -> int:
    """`fusedalign consolidate CHECKPOINT_DIR [OUTPUT_DIR]`: a sharded checkpoint as one from_pretrained model."""
    if _asks_for_help("consolidate", argv):
        return 0
    if len(argv) not in (1, 2) or any(a.startswith("-") for a in argv):
        raise CLIError(f"{CONSOLIDATE_USAGE}  (default OUTPUT_DIR: CHECKPOINT_DIR itself)")
    from fusedalign.distributed.checkpoints import consolidate_checkpoint

    checkpoint_dir = argv[0]
    output_dir = argv[1] if len(argv) == 2 else checkpoint_dir
    written = consolidate_checkpoint(checkpoint_dir, output_dir)
    print(f"[fusedalign] {checkpoint_dir}: whole model written to {written}; "
          f"load it with AutoModelForCausalLM.from_pretrained({output_dir!r}).", file=sys.stderr)
    return 0

