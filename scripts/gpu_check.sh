#!/usr/bin/env bash
# The GPU check: run from the repository root on a CUDA machine that already has torch, triton
# and pytest (the GPU image); installs nothing from the network. Takes a few minutes on one
# H200 (budget: under 8). Steps:
#   1. make `brigade` importable: an editable install without dependencies, or, where that
#      cannot be built offline, a symlinked package tree on PYTHONPATH;
#   2. the triton backend's whole test file, compiled on the GPU (fp32 vs the float64
#      reference, bf16/fp16 vs sdpa), then every other test marked `gpu`;
#   3. benchmarks/attention_kernels.py: triton vs sdpa timings (decode batch 1/8/64 x context
#      1k/8k, prefill chunks), bf16, head dim 128, 32q/8kv heads, page 16;
#   4. benchmarks/cuda_graph_decode.py: decode tokens/s, eager vs cuda-graph executor, batch
#      1/8/64 on a ~1B Llama-shaped random bf16 model, and batch 1 vs the bandwidth limit; then
#      mixed steps (8+8, 32+256, 64+448 decodes + prefill-chunk tokens), eager vs piecewise
#      graphs.
# Step 2 includes tests/test_cuda_graph.py (decode graphs and piecewise graphs vs eager),
# tests/test_piecewise.py (piecewise graphs vs eager, bf16, against fp32) and
# tests/test_flash_attn_backend.py.
# Exit status: non-zero if any test failed or the benchmark did not run.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
export PYTHONUNBUFFERED=1

if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible to $python (torch.cuda.is_available() is False)" >&2
    exit 2
fi
nvidia-smi -L 2>/dev/null || true
"$python" -c "import sys, torch, triton, pytest; print('python', sys.version.split()[0], \
'| torch', torch.__version__, '| triton', triton.__version__, '| pytest', pytest.__version__)" \
    || { echo "gpu_check: needs torch, triton and pytest importable by $python" >&2; exit 2; }

importable() { "$python" -c "import brigade.plugins.attention.triton_backend" 2>/dev/null; }
"$python" -m pip install --quiet --no-deps --no-build-isolation --disable-pip-version-check \
    -e . >/dev/null 2>&1 || true
if ! importable; then
    # pyproject maps brigade -> core/, brigade.interfaces -> interfaces/, brigade.plugins ->
    # plugins/; mirror that with links (no entry points, which the tests run here need not).
    tree=$(mktemp -d)
    mkdir "$tree/brigade"
    ln -s "$PWD"/core/* "$tree/brigade/"
    ln -s "$PWD/interfaces" "$tree/brigade/interfaces"
    ln -s "$PWD/plugins" "$tree/brigade/plugins"
    export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}"
    importable || { echo "gpu_check: cannot import brigade from $PWD" >&2; exit 2; }
    echo "gpu_check: brigade imported through a link tree at $tree (editable install failed)"
fi

status=0
pytest=("$python" -m pytest -q -p no:cacheprovider)
echo "== tests/test_triton_backend.py, compiled on the GPU"
timeout 300 "${pytest[@]}" tests/test_triton_backend.py || status=1
mapfile -t others < <(grep -l "mark.gpu" tests/test_*.py | grep -v test_triton_backend.py)
if [ "${#others[@]}" -gt 0 ]; then
    echo "== other tests marked gpu: ${others[*]}"
    timeout 180 "${pytest[@]}" -m gpu "${others[@]}" || status=1
fi
echo "== benchmarks/attention_kernels.py"
timeout 240 "$python" benchmarks/attention_kernels.py || status=1
echo "== benchmarks/cuda_graph_decode.py"
timeout 240 "$python" benchmarks/cuda_graph_decode.py || status=1
echo "gpu_check: $([ "$status" = 0 ] && echo passed || echo FAILED)"
exit "$status"
