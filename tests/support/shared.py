"""Helpers that tests in more than one folder use: random GGUF blocks, the CLI run in-process, and
the launch count of an HCA GPU decode step."""
from __future__ import annotations

import numpy as np
import torch

from kernels_cuda.launch import select_mode
from minirun.quant.formats import FORMATS


def random_blocks(rng, fmt, rows, cols, scale: float = 0.02) -> np.ndarray:
    """GGUF blocks [rows, bytes] of format `fmt` (minirun.quant.formats.FORMATS): random codes and
    scales (finite float16 scales ~ N(0, scale) of either sign, so every bit of every part is
    exercised)."""
    f = FORMATS[fmt]
    n = rows * cols // f.block
    raw = rng.integers(0, 256, (n, f.type_size), dtype=np.uint8)
    for name, off, size, dt in f.parts:
        if dt is np.float16:
            raw[:, off:off + 2] = (rng.standard_normal(n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def run_cli(args, capsys):
    from minirun.cli.main import main   # (click and the commands load only for the tests that run one)
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def decode_launches(tau: float, far: bool = False, exact_keys: bool = False, capped: bool = False,
                    dtype=torch.bfloat16, value_sum: str = "host") -> dict:
    """Launches per layer of one HCACacheCUDA decode step in HCA mode (times L for a token).

    kernels_cuda: decode_prep 1, build_lut 1 + approx_scores 2 (scores, ms_reduce) -- with exact
    keys none: torch's bmm and the scores' max and sum instead --, threshold_select 3 for a histogram cut (0 < tau < 1,
    or capped: zhist, zcut, zcompact) or 2, pack_selection 1, attend_partial 1 (2 with far
    positions: the sinks take the far query), lse_merge_staged 1. torch on the device: none (exact
    keys: bmm, its copy into z, amax, sub, exp, sum; a float16 model: the output cast); memcpys 2 (D2H pack, H2D
    stage), plus once per token the far turn's angles and, while the ring refills after a
    truncate, its slot mask. value_sum "gpu": gather_value_sum instead of pack_selection (the
    same kernel count) and no memcpy.
    """
    hist = select_mode(tau, 1 if capped else 0, 2) == 0
    k = 1 + (0 if exact_keys else 3) + (3 if hist else 2) + 1 + (2 if far else 1) + 1
    half_cast = dtype not in (torch.float32, torch.bfloat16)
    t = (6 if exact_keys else 0) + (1 if half_cast else 0)
    return {"kernels_cuda": k, "torch": t, "memcpy": 2 if value_sum == "host" else 0}
