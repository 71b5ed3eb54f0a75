"""Compile every kernels_cuda module once, one process per source file, into CuPy's kernel cache on
disk, so that the GPU tests' workers (and the benchmarks after them) load the compiled modules
instead of each compiling them again at the same time.

    python scripts/warm_cuda.py        # on a machine with a GPU and cupy; prints each file's time
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_cuda import _sources  # noqa: E402


def compile_file(name: str) -> tuple[str, float]:
    from kernels_cuda import launch
    t0 = time.perf_counter()
    launch._cupy_kernel(name, _sources.KERNELS[name][0], 0)   # (a module compiles when first asked for a kernel)
    return name, time.perf_counter() - t0


def main() -> int:
    t0 = time.perf_counter()
    with ProcessPoolExecutor(len(_sources.OPTIONS)) as ex:
        for name, dt in ex.map(compile_file, _sources.OPTIONS):
            print(f"   compiled {name} in {dt:.1f} s")
    print(f"   kernels_cuda compiled in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
