#!/usr/bin/env bash
# Compile-check every kernels_cuda/*.cu with nvcc (device code only, no GPU
# needed): sm_80 and sm_90 cubins, with and without --use_fast_math (pq.cu is
# built with it at run time).  Fails on any error or warning.
#
#   scripts/check_cuda.sh            # ARCHS="sm_80 sm_90" by default
#   ARCHS=sm_90 NVCC=/path/nvcc scripts/check_cuda.sh
set -uo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
ARCHS=${ARCHS:-"sm_80 sm_90"}
if ! command -v "$NVCC" >/dev/null 2>&1; then
    echo "check_cuda: nvcc not found (set NVCC=...)" >&2
    exit 2
fi
"$NVCC" --version | tail -n 2
shopt -s nullglob
files=(kernels_cuda/*.cu)
if [ ${#files[@]} -eq 0 ]; then
    echo "check_cuda: no kernels_cuda/*.cu found" >&2
    exit 2
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pids=()
names=()
for f in "${files[@]}"; do
    for arch in $ARCHS; do
        for fm in "" "--use_fast_math"; do
            name="$f $arch${fm:+ $fm}"
            log="$tmp/${#names[@]}.log"
            # shellcheck disable=SC2086
            "$NVCC" -std=c++17 -arch="$arch" --cubin -Werror all-warnings $fm -o /dev/null "$f" >"$log" 2>&1 &
            pids+=($!)
            names+=("$name")
        done
    done
done
status=0
for i in "${!pids[@]}"; do
    log="$tmp/$i.log"
    if ! wait "${pids[$i]}"; then
        echo "FAIL ${names[$i]}"
        cat "$log"
        status=1
    elif grep -qi "warning" "$log"; then
        echo "FAIL (warning) ${names[$i]}"
        cat "$log"
        status=1
    else
        echo "ok   ${names[$i]}"
    fi
done
if [ $status -eq 0 ]; then echo "check_cuda: all ${#pids[@]} compiles clean"; fi
exit $status
