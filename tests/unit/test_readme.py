"""Every ```python block of README.md runs as written, each in a fresh interpreter.

A block that fails (a name it never defines, an API that changed) fails here. Blocks that
train must leave a trainer that took steps and logged finite losses; the `token_logprobs`
block checks its own numbers against the full logits.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)

# Appended to a block that made a trainer: it trained, and what it logged is a number.
TRAINED = """
if "trainer" in globals():
    import math
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert trainer.state.global_step > 0 and losses and all(math.isfinite(x) for x in losses), losses
"""


def test_every_python_fence_is_collected():
    assert len(BLOCKS) == README.count("```python") >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(BLOCKS[index] + TRAINED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"README block {index}:\n{BLOCKS[index]}\n{done.stderr[-3000:]}"
