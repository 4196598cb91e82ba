"""`fusedalign merge` from anywhere: an adapter trained on a local base records its absolute path (a
relative one would read as a hub id elsewhere), and what cannot be found is one line with the way out."""

from __future__ import annotations

import json

from fusedalign.cli import main


def test_an_adapter_on_a_relative_local_base_merges_from_another_directory(tmp_path, monkeypatch):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(work)
    assert main(["sft", "--max_steps", "1", "--eval_strategy", "no", "--output_dir", "base"]) == 0
    assert main(["sft", "--model_name_or_path", "base", "--dataset_name", "builtin:zen", "--dataset_config",
                 "standard_language_modeling", "--use_peft", "--max_steps", "1", "--eval_strategy", "no",
                 "--output_dir", "adapter"]) == 0
    recorded = json.loads((work / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(work / "base")
    monkeypatch.chdir(elsewhere)
    assert main(["merge", str(work / "adapter"), "merged"]) == 0
    assert (elsewhere / "merged" / "model.safetensors").is_file()


def test_a_lora_run_says_it_saved_an_adapter(tmp_path, capsys):
    assert main(["sft", "--use_peft", "--max_steps", "1", "--eval_strategy", "no", "--output_dir", str(tmp_path)]) == 0
    assert "the LoRA adapter (fusedalign merge folds it into its base), tokenizer and metrics.jsonl saved in" in \
        capsys.readouterr().err


def test_what_merge_cannot_find_is_one_line(tmp_path, capsys):
    assert main(["merge", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "ADAPTER_DIR " + str(tmp_path / "nope") + " does not exist" in capsys.readouterr().err
    adapter = tmp_path / "adapter"
    assert main(["sft", "--use_peft", "--max_steps", "1", "--eval_strategy", "no", "--output_dir", str(adapter)]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "moved/away"  # a relative base from before absolute paths, say
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["merge", str(adapter), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'moved/away'" in err and "pass --base_model PATH" in err, err
    assert main(["merge", str(adapter), str(tmp_path / "out"), "--base_model", "builtin:tiny-qwen2"]) == 0


def test_help_read_by_a_reader_that_leaves_early_is_no_traceback():
    """`fusedalign merge --help | head -1`: the reader closes the pipe before the help is flushed."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "fusedalign", "merge", "--help"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # gone before the process writes
    err = proc.stderr.read().decode()
    assert proc.wait() == 0 and "Traceback" not in err and "BrokenPipeError" not in err, err
