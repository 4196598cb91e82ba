#!/usr/bin/env bash
# Every GPU test of the project, in one run of under 10 minutes on one H200: the tests marked
# `gpu` (skipped without CUDA) and those marked `cuda_path` (they run on the CPU in CI and take
# the CUDA path where a device is present: GRPO's default generator under bf16, say). Prints one
# summary line per test file, then pytest's closing line; the log and a JUnit file go to $OUT
# (default ./gpu-tests-out). Run it, to the end, for every change to code that runs on CUDA,
# before any benchmark of that change; record the run in docs/gpu-tests.md.
#
# A test marked `gpu` that is skipped here, where CUDA is present, proves nothing: the run then
# fails (exit 1, after pytest's closing line, a final line on stderr naming how many) unless the
# skip's reason matches ALLOWED_SKIPS below (tests/gate_skips.py records the skips).
#
# What the tests need beyond torch and transformers is installed from wheels in .whl/ when
# that folder exists (pip install --no-index --no-deps --target): a GPU machine without a
# package index gets them carried there (docs/gpu-tests.md lists them).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-tests-out}
LIMIT=${LIMIT:-560}  # seconds for the whole pytest run
mkdir -p "$OUT"
# Reasons (regular expressions on pytest's skip reason) for which a test marked gpu may skip with
# CUDA present: the CPU twin of a kernel test says it is tested compiled where CUDA is.
ALLOWED_SKIPS=('^CUDA present: ')
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_tests.sh: no CUDA device here; the GPU tests need one (CI runs the others)" >&2
    exit 2
fi
site=/tmp/fusedalign-gpu-site
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "gpu_tests.sh: installing .whl/*.whl failed" >&2; exit 2; }
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import accelerate, datasets, deepspeed, peft, transformers, triton" \
    || { echo "gpu_tests.sh: a package the tests need is missing (docs/gpu-tests.md: carry it in .whl/)" >&2; exit 2; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  } | tee "$OUT/machine.txt"
# SHARD=k/n runs the k-th of n shares of the test files (every n-th file from the k-th, in name
# order), for when the whole run would not fit one command's time; the shares together are
# the whole gate, and each prints its own closing line.
files=(tests/unit)
if [ -n "${SHARD:-}" ]; then
    k=${SHARD%/*} n=${SHARD#*/}
    [[ "$k" =~ ^[0-9]+$ && "$n" =~ ^[0-9]+$ && "$k" -ge 1 && "$k" -le "$n" ]] \
        || { echo "gpu_tests.sh: SHARD must be k/n with 1 <= k <= n, got '$SHARD'" >&2; exit 2; }
    mapfile -t all < <(ls tests/unit/test_*.py | sort)
    files=()
    for i in "${!all[@]}"; do [ $((i % n)) -eq $((k - 1)) ] && files+=("${all[$i]}"); done
    echo "gpu_tests.sh: share $k of $n: ${#files[@]} of ${#all[@]} test files"
fi
rm -f "$OUT/gpu-skips.txt"
FUSEDALIGN_GPU_SKIPS="$OUT/gpu-skips.txt" PYTHONUNBUFFERED=1 timeout -k 10 "$LIMIT" python3 -m pytest -q \
    -m "gpu or cuda_path" "${files[@]}" -p no:cacheprovider -p tests.gate_skips \
    --durations=15 --junitxml="$OUT/gpu-tests.xml" -o junit_family=xunit1 2>&1 | tee "$OUT/gpu-tests.log"
rc=${PIPESTATUS[0]}
python3 - "$OUT/gpu-tests.xml" <<'PY'
import collections, sys, xml.etree.ElementTree as ET
try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except (OSError, ET.ParseError) as error:
    sys.exit(f"no JUnit report ({error}): the run did not finish")
files = collections.defaultdict(collections.Counter)
for case in cases:
    outcome = "passed"
    for child in case:
        if child.tag in ("failure", "error"):
            outcome = "failed"
        elif child.tag == "skipped":
            outcome = "skipped"
    files[case.get("file") or case.get("classname", "?").rsplit(".", 1)[0].replace(".", "/") + ".py"][outcome] += 1
for name, counts in sorted(files.items()):
    print(f"{name}: " + ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped") if counts[k]))
PY
tail -n 1 "$OUT/gpu-tests.log"
[ "$rc" = 124 ] && echo "gpu_tests.sh: stopped at its ${LIMIT} s limit" >&2
if ! skips=$(python3 -m tests.gate_skips "$OUT/gpu-skips.txt" "${ALLOWED_SKIPS[@]}" 2>&1); then
    printf '%s\n' "$skips" >&2
    echo "gpu_tests.sh: FAILED: $(printf '%s\n' "$skips" | grep -c '^  skipped: ') test(s) marked gpu skipped" \
         "with CUDA present, for reasons not in ALLOWED_SKIPS (above): the gate has not passed" >&2
    [ "$rc" = 0 ] && rc=1
fi
exit "$rc"
