#!/usr/bin/env bash
# Sets up .venv, then runs the linters and the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The out-of-tree example plugin, installed the way a user installs a plugin, so that
# tests/plugin_api/test_example_plugin.py runs it end to end (and its own tests) against this checkout.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation -e examples/plugins/brigade-sjf
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
(cd examples/plugins/brigade-sjf && ../../../.venv/bin/mypy)
.venv/bin/python -m pytest "$@"
# The API fuzzed from its own OpenAPI document, briefly (the full run: scripts/fuzz.sh).
bash scripts/fuzz.sh --short
