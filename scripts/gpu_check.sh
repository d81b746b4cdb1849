#!/usr/bin/env bash
# The GPU check: run from the repository root on a CUDA machine that already has torch, triton,
# transformers and pytest (the GPU image); installs nothing from the network. Budget: under 8
# minutes on one H200 even when a step hangs (see "Time limits" below). Steps:
#   1. make `brigade` importable: an editable install without dependencies, or, where that
#      cannot be built offline, a symlinked package tree on PYTHONPATH;
#   2. the triton backend's and the fused small operations' whole test files, compiled on the
#      GPU (fp32 vs the float64 reference, bf16/fp16 vs sdpa; the fused kernels vs torch's
#      operations in fp32, bf16 and fp16);
#   3. every other test marked `gpu`, among them tests/plugins/models/test_gpu_parity.py:
#      greedy parity (tie-aware) of the engine with transformers `generate` on a small llama
#      in bf16 on the GPU, with the torch and the cuda-graph executor, a 16-token budget
#      mixing prefill chunks with decodes;
#   4. benchmarks/attention_kernels.py: triton vs sdpa timings (decode batch 1/8/64 x context
#      1k/8k, prefill chunks), bf16, head dim 128, 32q/8kv heads, page 16;
#   5. benchmarks/cuda_graph_decode.py: decode tokens/s, eager vs cuda-graph executor, batch
#      1/8/64 on a ~1B Llama-shaped random bf16 model, and batch 1 vs the bandwidth limit; then
#      mixed steps (8+8, 32+256, 64+448 decodes + prefill-chunk tokens), eager vs piecewise
#      graphs;
#   6. benchmarks/offline_throughput.py: brigade (cuda-graph executor, triton attention) vs
#      transformers `generate` tokens/s and their ratio, bf16 on the GPU, the mixed workload
#      at a quarter of its requests, small model.
# Step 3 also includes tests/plugins/executors/test_cuda_graph.py (decode graphs and piecewise
# graphs vs eager), tests/plugins/executors/test_piecewise.py (piecewise graphs vs eager, bf16,
# against fp32), tests/plugins/samplers/test_sampler.py (the standard sampler's portable draw
# and its filters on CUDA) and tests/plugins/attention/test_flash_attn_backend.py.
# Time limits: each step has a cap (the *_s variables below, 450 s = 7.5 minutes in all); a
# step may also use what earlier steps left of their caps, so the script's steps together never
# run past the sum of the caps, hung or not (plus the 5 s that `timeout -k` grants the last
# one after SIGTERM). A step that runs out of time is killed and counts as failed.
# Exit status: non-zero if any test failed or a benchmark did not run.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
export PYTHONUNBUFFERED=1

# Caps in seconds; their sum is the whole script's limit (SECONDS counts from its start).
setup_s=35 triton_tests_s=120 gpu_tests_s=90 attention_s=45 decode_s=100 throughput_s=60
total_s=$((setup_s + triton_tests_s + gpu_tests_s + attention_s + decode_s + throughput_s))
if [ "$total_s" -gt 450 ]; then
    echo "gpu_check: step caps sum to $total_s s, over the 450 s budget" >&2
    exit 2
fi
allowed_s=0  # the caps granted so far
grant() { allowed_s=$((allowed_s + $1)); }
# limited COMMAND...: run it until the time granted so far is spent (killed 5 s after TERM).
limited() {
    local left=$((allowed_s - SECONDS))
    if [ "$left" -lt 1 ]; then
        echo "gpu_check: no time left for: $*" >&2
        return 124
    fi
    timeout -k 5 "$left" "$@"
}

grant "$setup_s"
if ! limited "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
then
    echo "gpu_check: no CUDA GPU visible to $python (torch.cuda.is_available() is False)" >&2
    exit 2
fi
limited nvidia-smi -L 2>/dev/null || true
limited "$python" -c "import sys, torch, triton, transformers, pytest; print('python', \
sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, \
'| transformers', transformers.__version__, '| pytest', pytest.__version__)" \
    || { echo "gpu_check: needs torch, triton, transformers and pytest importable by $python" >&2
         exit 2; }

importable() {
    limited "$python" -c "import brigade.plugins.attention.triton_backend" 2>/dev/null
}
# At most 20 s, so that a stuck install leaves time for the link tree below.
limited timeout 20 "$python" -m pip install --quiet --no-deps --no-build-isolation \
    --disable-pip-version-check -e . >/dev/null 2>&1 || true
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
# step TITLE CAP COMMAND...: grant CAP, run COMMAND within the time left; failing or running
# out of time fails the check.
step() {
    local title=$1
    grant "$2"
    shift 2
    echo "== $title (limit $((allowed_s - SECONDS)) s)"
    limited "$@"
    local rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "gpu_check: $title: out of time" >&2
    fi
    [ "$rc" = 0 ] || status=1
}
pytest=("$python" -m pytest -q -p no:cacheprovider -rfE)
# Compiling the kernels' many specializations one after another took over 102 s on an H200
# (2026-12-04); with pytest-xdist's 8 workers the file ran in 21 s.
parallel=()
if "$python" -c "import xdist" 2>/dev/null; then parallel=(-n 8 -p no:benchmark); fi
triton_files=(tests/plugins/attention/test_triton_backend.py tests/plugins/gpu/test_fused_ops.py)
step "${triton_files[*]}, compiled on the GPU" "$triton_tests_s" \
    "${pytest[@]}" "${parallel[@]}" "${triton_files[@]}"
mapfile -t others < <(grep -rl --include="test_*.py" "mark.gpu" tests | sort \
    | grep -v -e test_triton_backend.py -e test_fused_ops.py)
if [ "${#others[@]}" -gt 0 ]; then
    echo "gpu_check: tests marked gpu in ${others[*]}"
    step "other tests marked gpu" "$gpu_tests_s" "${pytest[@]}" -m gpu "${others[@]}"
else
    grant "$gpu_tests_s"
fi
step "benchmarks/attention_kernels.py" "$attention_s" "$python" benchmarks/attention_kernels.py
step "benchmarks/cuda_graph_decode.py" "$decode_s" "$python" benchmarks/cuda_graph_decode.py
step "benchmarks/offline_throughput.py, bf16 on the GPU" "$throughput_s" \
    "$python" benchmarks/offline_throughput.py --size small --workload mixed --scale 0.25 \
    --device cuda --dtype bfloat16 --executor cuda-graph --set attention.plugin=triton
echo "gpu_check: $([ "$status" = 0 ] && echo passed || echo FAILED) in $SECONDS s"
exit "$status"
