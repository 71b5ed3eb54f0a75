"""CUDA C sources of kernels_cuda: file list, compile options, kernel names.

Importable without cupy (the compile-check test and the CPU emulator use it).
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent

# file -> NVRTC options.  --use_fast_math only for pq.cu: it has no exp/log/div,
# so fast math there only flushes denormals; scores.cu and attention.cu rely on
# IEEE -inf/NaN behaviour and bit-identical bin arithmetic, and gather.cu's grouped
# gather recomputes scores.cu's bins (mr_bin): the two must keep the same options.
OPTIONS: dict[str, tuple[str, ...]] = {
    "pq.cu": ("-std=c++17", "--use_fast_math"),
    "scores.cu": ("-std=c++17",),
    "attention.cu": ("-std=c++17",),
    "decode.cu": ("-std=c++17",),
    "gather.cu": ("-std=c++17",),
    "layer.cu": ("-std=c++17",),
    "quant.cu": ("-std=c++17",),
}

# file -> extern "C" entry points the wrappers launch: each kernel once per element type (the
# key / value dtype, the code dtype, the gather's or attend_gqa's group size).
_KV = ("f32", "f16", "bf16")
_F32_BF16 = ("f32", "bf16")
KERNELS: dict[str, tuple[str, ...]] = {
    "pq.cu": ("build_lut_f32", *(f"encode_keys_{t}_{i}" for t in _KV for i in ("u8", "i16"))),
    "scores.cu": ("approx_scores_u8", "approx_scores_i16", "ms_reduce", "zhist", "zcut", "zcompact"),
    "attention.cu": (*(f"attend_partial_{t}" for t in _KV), *(f"attend_gqa_{t}_g{g}" for t in _KV for g in (4, 8))),
    "decode.cu": (*(f"decode_prep_{t}" for t in _KV), "pack_selection_i32",
                  *(f"lse_merge_staged_{t}" for t in _F32_BF16), "store_rows_b16", "store_rows_b32"),
    "gather.cu": tuple(f"gather_value_sum_grouped_{t}_g{g}" for t in (*_KV, "q8", "q4") for g in (3, 4, 8)),
    "layer.cu": tuple(f"{k}_{t}" for k in ("rms_norm", "add_rms_norm", "rope", "silu_mul", "rope_store") for t in _F32_BF16),
    "quant.cu": tuple(f"{k}_{f}" for k in ("qgemv", "qrows") for f in ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")),
}

HEADERS = ("common.cuh",)
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.M)


def raw_text(name: str) -> str:
    return (HERE / name).read_text(encoding="utf-8")


def source(name: str) -> str:
    """The text handed to NVRTC: `name` with its local #include "..." lines
    replaced by the header text (once per header), so that CuPy's on-disk
    compile cache keys on everything that is compiled."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def repl(mo: re.Match) -> str:
            hdr = mo.group(1)
            if hdr not in HEADERS:
                raise ValueError(f"{name}: unexpected #include \"{hdr}\"")
            if hdr in seen:
                return ""
            seen.add(hdr)
            return f'// ---- begin {hdr}\n{expand(raw_text(hdr))}\n// ---- end {hdr}'

        return _INCLUDE_RE.sub(repl, text)

    return expand(raw_text(name))


def constant(name: str, macro: str) -> int:
    """Integer value of `#define macro N` in source file `name` (launch geometry
    shared between a kernel and its wrapper)."""
    mo = re.search(rf"^#define\s+{re.escape(macro)}\s+(\d+)\b", raw_text(name), re.M)
    if mo is None:
        raise KeyError(f"{macro} not defined in {name}")
    return int(mo.group(1))
