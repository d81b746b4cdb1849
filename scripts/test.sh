#!/usr/bin/env bash
# Sets up .venv, then runs the linters and the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The out-of-tree example plugins, installed the way a user installs a plugin, so that
# tests/plugin_api/test_example_plugin.py runs them end to end (and their own tests) against this
# checkout, and tests/plugin_api/test_conformance.py checks their components with the built-ins'.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -e examples/plugins/brigade-sjf -e examples/plugins/brigade-example-stations
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
(cd examples/plugins/brigade-sjf && ../../../.venv/bin/mypy)
(cd examples/plugins/brigade-example-stations && ../../../.venv/bin/mypy)
.venv/bin/python -m pytest "$@"
# The kernels' AVX2 code paths, also on an AVX-512 machine: the kernel tests again, built for
# x86-64-v3 in a cache of their own (test_build.py checks that they ran 8-lane vectors). oneDNN
# picks its own ISA whatever the target, so its variants are left to the run above.
if [ "$(uname -m)" = x86_64 ]; then
    BRIGADE_CPU_MARCH=x86-64-v3 BRIGADE_CACHE_DIR="$PWD/.cache/avx2" .venv/bin/python -m pytest -q \
        tests/plugins/cpu tests/plugins/attention/test_paged_attention.py tests/plugins/samplers \
        -k "not amx and not onednn"
fi
# The API fuzzed from its own OpenAPI document, briefly (the full run: scripts/fuzz.sh).
bash scripts/fuzz.sh --short
