#!/usr/bin/env bash
# The one command a GPU run uses: every check of scripts/gpu_check.py, each section under its own time budget
# (7 minutes in all at most, gpu_check.TOTAL_BUDGET, for a 15-minute device session), every result as JSON under docs/gpu/ (docs/gpu/README.md).
#
#   bash scripts/gpu_check.sh                         # GPU: writes docs/gpu/<section>.json and summary.json
#   bash scripts/gpu_check.sh --dry-run --out DIR     # the same steps on the CPU (Triton interpreter, tiny shapes)
#   bash scripts/gpu_check.sh --sections kernels mfu --peak-tflops 989   # a subset; see --help
#
# Exit code 0 when every section passed, 1 when any failed (its JSON says why). PYTHON picks the interpreter
# (default: the project's .venv if there is one, else python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=$(command -v python3 || command -v python); fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== environment ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(hostname))"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi || true
else
    echo "nvidia-smi: not found"
fi
"$PYTHON" - <<'PY'
import platform
from importlib.metadata import PackageNotFoundError, version  # versions without importing torch (seconds on a CPU)


def v(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


print(f"python {platform.python_version()}, " + ", ".join(f"{n} {v(n)}" for n in ("torch", "triton", "lightning")))
PY
exec "$PYTHON" scripts/gpu_check.py "$@"
