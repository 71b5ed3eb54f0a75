"""What bounds a GPU step, for scripts/bench_gpu.py: a few decode steps or a prefill under torch.profiler
(wall time, the device's kernel time, the top kernels) and under cProfile (the host's Python)."""
from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import time

import torch

from minirun.tools import bench as mb


def sync(eng):
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


def _activities(eng) -> list:
    from torch.profiler import ProfilerActivity
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device.type == "cuda" else [])


def _kernels(prof, eng, rows: int) -> tuple[float, str]:
    """(summed device kernel seconds, the top `rows` ops by their own time) of a torch profile."""
    ev = prof.key_averages()
    gpu = sum(getattr(e, "self_device_time_total", 0) or 0 for e in ev) / 1e6
    table = ev.table(sort_by="self_cuda_time_total" if eng.device.type == "cuda" else "self_cpu_time_total",
                     row_limit=rows, max_name_column_width=48)
    return gpu, table


def _python(pr: cProfile.Profile, rows: int, *orders: str) -> str:
    buf = io.StringIO()
    for order in orders:
        pstats.Stats(pr, stream=buf).sort_stats(order).print_stats(rows)
    return buf.getvalue()


def profile_steps(eng, ids: list[int], k: int = 3) -> str:
    """k decode steps under torch.profiler: wall and summed GPU kernel time per token, top ops (what
    a step is bound by: the GPU's work, or the host's launches and waits), then host_profile."""
    from torch.profiler import profile
    logits, _ = eng.prefill(ids)
    tok = int(logits[-1].argmax())
    with profile(activities=_activities(eng)) as prof:
        t0 = time.perf_counter()
        for _ in range(k):
            tok = int(eng.step(tok)[-1].argmax())
        sync(eng)
        wall = (time.perf_counter() - t0) / k
    eng.rewind(len(ids))
    gpu, table = _kernels(prof, eng, 12)
    return (f"profile: wall {wall * 1e3:.2f} ms/token, GPU kernels {gpu / k * 1e3:.2f} ms/token\n{table}\n"
            + host_profile(eng, ids, tok, k))


def host_profile(eng, ids: list[int], tok: int, k: int) -> str:
    """The host's side of k decode steps (after the profiled ones: graphs captured), under cProfile:
    the Python functions by their own and their cumulative time, to tell what keeps the host busy
    around each token."""
    eng.prefill(ids)
    tok = int(eng.step(tok)[-1].argmax())   # (any capture happens here, outside the profile)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(k):
        tok = int(eng.step(tok)[-1].argmax())
    sync(eng)
    pr.disable()
    eng.rewind(len(ids))
    return f"host profile ({k} steps, cProfile, by own time, then cumulative):\n" + _python(pr, 15, "tottime",
                                                                                            "cumulative")


def prefill_profile(eng, ids: list[int]) -> str:
    """The prefill of ids from an empty cache (the long prompt's mode: anchor, codebooks fitted on
    its first keys) under torch.profiler, then again under cProfile: wall and GPU kernel seconds,
    the top kernels, the host's Python -- what bounds a prefill chunk. Resets the cache."""
    from torch.profiler import profile
    out = []
    for how in ("torch", "cprofile"):
        eng.reset()
        mb._forget_fitted_codebooks(eng)
        sync(eng)
        prof = profile(activities=_activities(eng)) if how == "torch" else cProfile.Profile()
        t0 = time.perf_counter()
        with prof if how == "torch" else contextlib.nullcontext():
            if how == "cprofile":
                prof.enable()
            eng.prefill(ids)
            sync(eng)
            if how == "cprofile":
                prof.disable()
        wall = time.perf_counter() - t0
        if how == "torch":
            gpu, table = _kernels(prof, eng, 15)
            out.append(f"prefill profile: {len(ids)} tokens ({eng.last_prefill['mode']}): wall {wall:.2f} s under "
                       f"the profiler, GPU kernels {gpu:.2f} s\n" + table)
        else:
            out.append(f"prefill host profile (cProfile, wall {wall:.2f} s):\n" + _python(prof, 20, "tottime"))
    eng.reset()
    return "\n".join(out)
