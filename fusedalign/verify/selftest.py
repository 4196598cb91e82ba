"""`fusedalign verify --self_test`: each known bug class, injected, is caught; a check that cannot fail is no check.

Each case runs verify's comparison twice on the same launch: the run as it is (it must
agree with the oracle) and the same run with one bug injected (`inject.py`; it must
disagree or crash). The cases run on the embedded tiny models and data, on the backend
where the bug bites:

| injection           | trainer, model                          | where            |
|---------------------|-----------------------------------------|------------------|
| head_by_attribute   | sft, builtin:tiny-qwen2                 | zero3, 2 processes |
| per_micro_batch     | sft, builtin:tiny-qwen2                 | ddp, 2 processes |
| softcap_dropped     | sft, builtin:tiny-gemma2, cap 0.5 (*)   | one process      |
| lora_head_no_grad   | sft, builtin:tiny-qwen2, LoRA on lm_head | one process      |

(*) The tiny model's logits are nearly flat (|logit| << 1), where its cap of 30 changes
nothing, so a dropped cap would not show; the case runs a copy with the cap lowered to
0.5, written in the self-test's directory, where the cap binds as Gemma 2's does on real
logits of ~30.

Exit 0 when every injection is caught and every clean run agrees, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any

from fusedalign.errors import CLIError

SFT = ["--bf16", "false", "--dataset_name", "builtin:zen", "--dataset_config", "standard_language_modeling",
       "--per_device_train_batch_size", "2", "--max_length", "64"]
QWEN = ["--model_name_or_path", "builtin:tiny-qwen2", *SFT]


@dataclass(frozen=True)
class Case:
    injection: str
    argv: tuple[str, ...]
    backend: str | None  # None: one process


CAPPED = "{capped_gemma2}"  # replaced by the path of the copy `capped_gemma2` writes


CASES = (
    Case("head_by_attribute", tuple(QWEN), "zero3"),
    Case("per_micro_batch", tuple(QWEN), "ddp"),
    Case("softcap_dropped", ("--model_name_or_path", CAPPED, *SFT), None),
    Case("lora_head_no_grad", (*QWEN, "--use_peft", "--lora_target_modules", "q_proj", "v_proj", "lm_head"), None),
)
SOFTCAP = 0.5


def capped_gemma2(workdir: str) -> str:
    """builtin:tiny-gemma2 with its final-logit soft-cap lowered to SOFTCAP, where the cap binds."""
    from fusedalign.models import resolve_model_path

    path = os.path.join(workdir, "tiny-gemma2-capped")
    shutil.copytree(resolve_model_path("builtin:tiny-gemma2"), path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["final_logit_softcapping"] = SOFTCAP
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def with_capped_model(cases: tuple[Case, ...], workdir: str) -> tuple[Case, ...]:
    path = capped_gemma2(workdir) if any(CAPPED in case.argv for case in cases) else ""
    return tuple(Case(c.injection, tuple(path if a == CAPPED else a for a in c.argv), c.backend) for c in cases)


def case_launches(cases: tuple[Case, ...]) -> tuple[list, list[tuple[Case, str, str]]]:
    """The launches of the self-test, and per case the names of its clean and injected runs."""
    from fusedalign.verify.plan import VerifyOptions, backend_config, merged, plan

    plans, pairs, oracles = [], [], {}
    for case in cases:
        configs = [(case.backend, backend_config(case.backend))] if case.backend else []
        # Cases with the same flags and world size share an oracle.
        prefix = oracles.setdefault((case.argv, case.backend is None), f"{case.injection}_")
        launches = plan(VerifyOptions("sft", list(case.argv), configs), prefix)
        single, *backends = launches
        oracle = single.runs[0]
        tested = backends[0].runs[0] if backends else single.runs[1]  # the fused run
        clean = {**tested, "name": f"{case.injection}_clean", "label": f"{tested['label']}"}
        bug = {**tested, "name": f"{case.injection}_injected", "label": f"{tested['label']}, {case.injection}",
               "inject": case.injection}
        clean["oracle"] = bug["oracle"] = oracle["name"]
        single.runs = [oracle] if prefix == f"{case.injection}_" else []
        target = backends[0] if backends else single
        # float32 everywhere, as the CPU configs are: a GPU config's bf16 would loosen the tolerances.
        target.launch_args = ["--mixed_precision", "no"] if backends else []
        target.runs = [*target.runs, clean, bug] if target is single else [clean, bug]
        plans.append(launches)
        pairs.append((case, clean["name"], bug["name"]))
    return merged(plans), pairs


def caught(clean: Any, bug: Any) -> bool:
    """The clean run agrees with the oracle and the injected one does not (or crashed)."""
    return clean.agrees and not bug.agrees


def run_self_test(argv: list[str]) -> int:
    from fusedalign.verify.command import run_plan, workspace

    keep = "--keep_outputs" in argv
    unknown = [a for a in argv if a != "--keep_outputs"]
    if unknown:
        raise CLIError(f"--self_test takes no other flag than --keep_outputs, got {unknown[0]}.")
    workdir = workspace(keep)
    try:
        launches, pairs = case_launches(with_capped_model(CASES, workdir))
        results = {run["name"]: cmp for run, cmp in run_plan(launches, workdir)}
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(self_test_table(pairs, results))
    failures = [case.injection for case, clean, bug in pairs if not caught(results[clean], results[bug])]
    if failures:
        print(f"fusedalign verify --self_test: not shown for {', '.join(failures)}", file=sys.stderr)
        return 1
    print("fusedalign verify --self_test: every injected bug was caught, and every clean run agrees.", file=sys.stderr)
    return 0


def self_test_table(pairs: list[tuple[Case, str, str]], results: dict[str, Any]) -> str:
    from fusedalign.verify.report import verdict

    lines = ["| injection | where | without it | with it | caught |", "|---|---|---|---|---|"]
    for case, clean, bug in pairs:
        where = f"{case.backend}, 2 processes" if case.backend else "one process"
        lines.append(f"| {case.injection} | {where} | {verdict(results[clean])} | {verdict(results[bug])} | "
                     f"{'yes' if caught(results[clean], results[bug]) else 'NO'} |")
    return "\n".join(lines)
