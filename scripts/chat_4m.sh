#!/usr/bin/env bash
# The headline on the real model: a 4M-token chat (Botchan repeated, a pass key in the middle) on one
# GPU, `minirun chat --file` as a user runs it, with the question piped in. Records the prefill time,
# the decode tokens/s, peak GPU and host memory, the answer and whether it holds the pass key, in
# OUT_DIR/chat_4m.json (and the chat's output in OUT_DIR/chat_4m.log).
#
# The model travels as its GGUF in two halves (a device call carries at most 64 MiB), so three steps:
#   here, once:        bash scripts/chat_4m.sh prep          # .gpu/a: GGUF half 1 + the gguf wheel
#                                                            # .gpu/b: half 2 + Botchan + codebooks
#   device call 1:     carry [".gpu/a"]  bash scripts/chat_4m.sh receive
#   device call 2:     carry [".gpu/b"]  bash scripts/chat_4m.sh run OUT_DIR    (at once: the machine
#                      keeps what call 1 left only while it stays warm, 30 s)
# The rehearsal on the CPU (tests/tools/test_bench_gpu.py): a model directory and a short text instead:
#   DEVICE=cpu MODEL=DIR BOOK=text.txt COPIES=2 CTX=8K bash scripts/chat_4m.sh run OUT_DIR
# SmolLM2 is trained to 8K: the chat runs with far positions on past it (docs/QUALITY.md).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?usage: chat_4m.sh prep|receive|run [OUT_DIR]}
KEEP=${KEEP:-/root/minirun-4m}
GGUF=${GGUF:-$(ls "$HOME"/.cache/minirun/*/SmolLM2-135M-Instruct.Q4_1.gguf 2>/dev/null | head -1)}
BOOK=${BOOK:-$HOME/.cache/minirun/botchan.txt}
DEVICE=${DEVICE:-cuda}
CTX=${CTX:-4M} COPIES=${COPIES:-59}   # 59 copies of Botchan: 4,141,317 SmolLM2 tokens (63 pass 4M)
KEY_AT=${KEY_AT:-0.5}                 # where the pass key goes (a fraction of the text)
QUESTION=${QUESTION:-What is the pass key mentioned in the text? Answer with the number only.}
KV_BUDGET=${KV_BUDGET:-g64c16} FAR=${FAR:-on} MAX_SELECT=${MAX_SELECT:-2048}
CHAT_LIMIT=${CHAT_LIMIT:-540}         # seconds: SIGINT then, which stops the answer as Ctrl-C does
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

case $STAGE in
prep)
    [ -f "$GGUF" ] || { echo "chat_4m: no GGUF at '$GGUF' (set GGUF=...)" >&2; exit 2; }
    [ -f "$BOOK" ] || { echo "chat_4m: no $BOOK (python scripts/eval_quality.py --botchan fetches it)" >&2; exit 2; }
    rm -rf .gpu && mkdir -p .gpu/a .gpu/b
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
    split -b $(( ($(stat -c %s "$GGUF") + 1) / 2 )) -d "$GGUF" .gpu/part
    mv .gpu/part00 .gpu/a/ && mv .gpu/part01 .gpu/b/
    sha256sum "$GGUF" | cut -d' ' -f1 >.gpu/a/gguf.sha256
    ${PIP:-.venv/bin/pip} download -q --no-deps --only-binary=:all: -d .gpu/a "gguf==0.19.0" || exit 1
    cp "$BOOK" .gpu/b/book.txt
    find "$(dirname "$GGUF")" models -name 'codebooks-g64-c16*.safetensors' -size -8M -exec cp {} .gpu/b/ \; 2>/dev/null
    du -sh .gpu/a .gpu/b
    ;;
receive)
    [ -f .gpu/a/part00 ] || { echo "chat_4m: .gpu/a not carried (run prep here, carry .gpu/a)" >&2; exit 2; }
    mkdir -p "$KEEP" && cp .gpu/a/* "$KEEP/" && ls "$KEEP"
    ;;
run)
    OUT_DIR=${2:?usage: chat_4m.sh run OUT_DIR}
    mkdir -p "$OUT_DIR"
    if [ -z "${MODEL:-}" ]; then    # the device: join the halves, convert
        MODEL=$KEEP/SmolLM2-135M-Instruct
        [ -f "$KEEP/part00" ] || { echo "chat_4m: $KEEP/part00 missing: run 'receive' first (same warm machine)" >&2; exit 2; }
        cat "$KEEP/part00" .gpu/b/part01 >"$KEEP/model.gguf"
        [ "$(sha256sum "$KEEP/model.gguf" | cut -d' ' -f1)" = "$(cat "$KEEP/gguf.sha256")" ] \
            || { echo "chat_4m: the joined GGUF does not match its checksum" >&2; exit 1; }
        $PY -m pip install -q --no-index --no-deps --target "$KEEP/site" "$KEEP"/gguf-*.whl || exit 1
        export PYTHONPATH=$PYTHONPATH:$KEEP/site
        [ -d "$MODEL" ] || $PY -m minirun convert "$KEEP/model.gguf" "$MODEL" --dtype bfloat16 || exit 1
        cp .gpu/b/codebooks-*.safetensors "$MODEL/" 2>/dev/null
        BOOK=.gpu/b/book.txt
    fi
    $PY - "$BOOK" "$OUT_DIR/book4m.txt" "$COPIES" "$KEY_AT" <<'EOF'
import sys
book, n, at = open(sys.argv[1]).read(), int(sys.argv[3]), float(sys.argv[4])
text = "\n\n".join([book] * n)
cut = text.rfind("\n", 0, int(len(text) * at)) + 1
key = "\nThe pass key is 48213. Remember it. 48213 is the pass key.\n"
open(sys.argv[2], "w").write(text[:cut] + key + text[cut:])
EOF
    smi=
    if [ "$DEVICE" != cpu ] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$OUT_DIR/gpu_mem_mib.txt" &
        smi=$!
    fi
    timer=(); [ -x /usr/bin/time ] && timer=(/usr/bin/time -f "peak host KiB: %M")
    start=$(date +%s)
    printf '%s\n' "$QUESTION" |
        "${timer[@]}" timeout -s INT -k 20 "$CHAT_LIMIT" $PY -m minirun chat "$MODEL" --ctx "$CTX" \
            --file "$OUT_DIR/book4m.txt" --kv hca --kv-budget "$KV_BUDGET" --hca-opt far_positions="$FAR" \
            ${MAX_SELECT:+--max-select "$MAX_SELECT"} --dtype bfloat16 --device "$DEVICE" --kv-report -n 24 \
            2>&1 | tr '\r' '\n' | grep -v -E '^(prefill|prompt):' | tee "$OUT_DIR/chat_4m.log"
    rc=${PIPESTATUS[1]}
    [ -n "$smi" ] && kill "$smi"
    $PY - "$OUT_DIR" "$(( $(date +%s) - start ))" "$rc" <<'EOF'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
log = (out / "chat_4m.log").read_text()
def grab(pat, cast=float):
    m = re.search(pat, log)
    return cast(m.group(1)) if m else None
mem = out / "gpu_mem_mib.txt"
gpu = [int(x) for x in mem.read_text().split()] if mem.is_file() and mem.read_text().strip() else []
answer = log.split(">>> ", 1)[1].split("\n[prompt", 1)[0].strip() if ">>> " in log else ""
res = {"tokens": grab(r"\[document: (\d+) tokens", int), "prefill_s": grab(r"prefilled in ([\d.]+)s"),
       "prefill_tps": grab(r"prefilled in [\d.]+s \((\d+) tok/s"), "decode_tps": grab(r"answer \d+ tok.*?, ([\d.]+) tok/s\]"),
       "answer": answer, "passkey_found": "48213" in answer, "peak_gpu_mib": max(gpu) if gpu else None,
       "peak_host_kib": grab(r"peak host KiB: (\d+)", int), "wall_s": int(sys.argv[2]),
       "exit": int(sys.argv[3]), "stopped_at_limit": sys.argv[3] == "124"}
(out / "chat_4m.json").write_text(json.dumps(res, indent=1))
print("chat_4m:", json.dumps(res))
EOF
    [ "$rc" = 0 ] || [ "$rc" = 124 ] || exit "$rc"    # (124: stopped at CHAT_LIMIT, its figures so far kept)
    ;;
*)
    echo "chat_4m: unknown stage $STAGE (prep, receive, run)" >&2
    exit 2
    ;;
esac
