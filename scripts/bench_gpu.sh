#!/usr/bin/env bash
# Everything the GPU path claims, measured in one command of at most 9 minutes on an H100: the
# environment and nvcc, the GPU tests (every kernel against its reference, the GPU cache against the
# CPU cache, tau = 1 against dense), then scripts/bench_gpu.py's steps (decode and prefill speeds,
# memory per tier; its docstring lists them) inside what is left of BUDGET seconds. Logs, JSON and
# summary.md go into OUT_DIR; the summary table is printed last.
#
#   bash scripts/bench_gpu.sh OUT_DIR                                # on a GPU machine
#   DEVICE=cpu bash scripts/bench_gpu.sh OUT_DIR                     # the rehearsal: tiny sizes, CPU, emulator
#   STEPS=hca-0.125,deep-0.125 BUDGET=300 bash scripts/bench_gpu.sh OUT_DIR   # some steps only
#   STEPS=llama8b TESTS= BUDGET=480 bash scripts/bench_gpu.sh OUT_DIR   # Llama-3-8B at 1M (its prefill
#                                                                      # ~5 minutes): a call of its own
#   TESTS= ...                                                       # no tests stage
# Through the device tool (at most 8 files come back: pack the directory, without the random
# checkpoints; the quant step needs the `gguf` package, which the device image lacks: carry its wheel
# in .whl and install it first):
#   pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   bash scripts/bench_gpu.sh /tmp/bg; tar czf $OUT/bench_gpu.tgz --exclude=work -C /tmp bg
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:?usage: bench_gpu.sh OUT_DIR}
DEVICE=${DEVICE:-cuda}
BUDGET=${BUDGET:-530}          # seconds for the whole command
PY=${PY:-python3}
if [ "$DEVICE" = cpu ]; then
    SCALE=${SCALE:-tiny}; EMULATE=--emulate
    TESTS=${TESTS-tests/kernels/test_kernels_cuda_decode.py::test_wrapper_argument_errors}
else
    SCALE=${SCALE:-full}; EMULATE=
    TESTS=${TESTS-tests/kv/test_hca_cache.py::test_gpu_exact_tier_partial_is_the_masked_attention \
tests/model/test_dense_decode.py tests/kernels/test_kernels_cuda_layer.py tests/kernels/test_kernels_cuda.py tests/kernels/test_kernels_cuda_decode.py \
tests/kernels/test_kernels_cuda_live.py tests/kv/test_hca_cuda.py tests/model/test_cuda_graph.py tests/kv/test_rescore.py \
tests/kernels/test_quant_cuda.py}
fi
TEST_LIMIT=${TEST_LIMIT:-100}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
start=$(date +%s)

{
    date -u
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $PY -c "import torch, numba; print('torch', torch.__version__, torch.version.cuda, '| numba', numba.__version__)"
    $PY -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tail -1
    nproc; free -g | head -2
    # (the CPU rehearsal leaves nvcc out: tests/kernels/test_cuda_compile.py compiles every kernel)
    if [ "$DEVICE" = cpu ]; then echo "nvcc: not checked on the CPU"
    elif command -v nvcc >/dev/null; then timeout 60 env ARCHS=sm_90 bash scripts/check_cuda.sh | tail -3; else echo "no nvcc"; fi
} 2>&1 | tee "$OUT_DIR/env.txt"

if [ "$DEVICE" != cpu ]; then   # each module compiled once, before a dozen test workers would each compile it
    timeout -k 5 90 $PY scripts/warm_cuda.py 2>&1 | tail -9 | tee -a "$OUT_DIR/env.txt"
fi

if [ -n "$TESTS" ]; then
    par=(); $PY -c "import xdist" 2>/dev/null && [ "$DEVICE" != cpu ] && par=(-n "${TEST_PROCS:-12}")
    per=(); $PY -c "import pytest_timeout" 2>/dev/null && per=(--timeout 90)
    echo "== tests (limit $TEST_LIMIT s)"
    # shellcheck disable=SC2086
    timeout -k 5 "$TEST_LIMIT" $PY -m pytest -v -rfEs --durations=30 -p no:cacheprovider -p no:benchmark "${par[@]}" "${per[@]}" -k "not emu" $TESTS \
        >"$OUT_DIR/tests.log" 2>&1
    echo "   tests: exit $? ($(grep -c PASSED "$OUT_DIR/tests.log") passed; $(grep -E "(FAILED|ERROR) " "$OUT_DIR/tests.log" | sed "s/.*\(FAILED\|ERROR\) //" | sort -u | head -8 | tr "\n" " "))" | tee -a "$OUT_DIR/env.txt"
fi

left=$(( BUDGET - ($(date +%s) - start) ))
# shellcheck disable=SC2086
$PY scripts/bench_gpu.py run "$OUT_DIR" --device "$DEVICE" --scale "$SCALE" --budget "$left" \
    ${STEPS:+--steps "$STEPS"} $EMULATE
