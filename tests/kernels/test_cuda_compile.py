"""Compile checks of kernels_cuda (no GPU needed): every kernels_cuda/*.cu with nvcc (sm_80 /
sm_90, with the run-time options, warnings are errors) and, when a libnvrtc is found, with NVRTC
on exactly the text CuPy compiles; the sources are self-contained; kernels_cuda imports without
cupy or torch."""
from __future__ import annotations

import ast
import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kernels_cuda
from kernels_cuda import _sources

ROOT = Path(__file__).resolve().parents[2]
CU_FILES = sorted(p.name for p in _sources.HERE.glob("*.cu"))
HAVE_GPU = kernels_cuda.available()

# ---------------------------------------------------------------------------
# Compile checks (no GPU needed)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("cu", CU_FILES)
def test_cuda_sources_compile(cu, arch):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc not found: cannot compile-check the CUDA sources")
        pytest.skip("nvcc not found")
    opts = list(_sources.OPTIONS.get(cu, ("-std=c++17",)))
    cmd = [nvcc, *opts, f"-arch={arch}", "--cubin", "-Werror", "all-warnings", "-o", os.devnull, cu]
    res = subprocess.run(cmd, cwd=_sources.HERE, capture_output=True, text=True)
    log = res.stdout + res.stderr
    assert res.returncode == 0, f"{' '.join(cmd)}\n{log}"
    assert "warning" not in log.lower(), log


def _find_nvrtc():
    cands = []
    if os.environ.get("MINIRUN_NVRTC"):
        cands.append(os.environ["MINIRUN_NVRTC"])
    found = ctypes.util.find_library("nvrtc")
    if found:
        cands.append(found)
    for base in [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda", *sys.path]:
        if base:
            cands += sorted(glob.glob(os.path.join(base, "lib64", "libnvrtc.so*")))
            cands += sorted(glob.glob(os.path.join(base, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
            cands += sorted(glob.glob(os.path.join(base, "nvidia", "cu*", "lib", "libnvrtc.so*")))
    for c in cands:
        if "builtins" in c or ".alt." in c:
            continue
        try:
            return ctypes.CDLL(c), c
        except OSError:
            continue
    return None, None


def _nvrtc_compile(lib, src: str, name: str, opts: list[str]) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram failed ({rc})"
    try:
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(max(1, size.value))
        lib.nvrtcGetProgramLog(prog, buf)
        return rc, buf.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("cu", CU_FILES)
def test_cuda_sources_compile_nvrtc(cu, arch):
    """The exact text CuPy hands to NVRTC (common.cuh inlined, run-time options)."""
    lib, path = _find_nvrtc()
    if lib is None:
        print("libnvrtc not found (set MINIRUN_NVRTC=/path/libnvrtc.so): NVRTC check skipped")
        pytest.skip("libnvrtc not found")
    opts = [*_sources.OPTIONS[cu], f"--gpu-architecture={arch}"]
    rc, log = _nvrtc_compile(lib, _sources.source(cu), cu, opts)
    assert rc == 0, f"NVRTC ({path}) failed on {cu}:\n{log}"
    assert "warning" not in log.lower(), log


def test_sources_self_contained():
    """No headers beyond common.cuh (NVRTC has no host headers); the entry points the
    wrappers (launch.py, ops.py, decode.py, layer.py, quant.py) launch exist as extern "C" kernels and every such kernel is listed."""
    import cuda_emu

    assert set(CU_FILES) == set(_sources.OPTIONS) == set(_sources.KERNELS)
    for cu in CU_FILES + list(_sources.HEADERS):
        for inc in re.findall(r"^\s*#\s*include\s*([<\"][^>\"]+[>\"])", _sources.raw_text(cu), re.M):
            assert inc == '"common.cuh"', f"{cu} includes {inc}"
    for cu in CU_FILES:
        src = _sources.source(cu)
        assert not re.search(r"^\s*#\s*include", src, re.M), f"{cu}: unexpanded #include"
        assert set(cuda_emu.signatures(cu)) == set(_sources.KERNELS[cu]), cu
    ops_text = "".join((_sources.HERE / f).read_text() for f in ("launch.py", "ops.py", "decode.py", "layer.py",
                                                                   "quant.py"))
    for names in _sources.KERNELS.values():
        for name in names:
            stem = re.sub(r"(_(f32|f16|bf16|u8|i16|i32|i64|q8|q4|g\d))+$", "", name)   # (dtype, index type, group)
            assert stem in ops_text, f"{name} is never launched"


def test_import_without_cupy_or_torch():
    code = "import sys, kernels_cuda; assert 'cupy' not in sys.modules and 'torch' not in sys.modules; print('ok')"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
    if not HAVE_GPU:
        assert kernels_cuda.available() is False


def test_runtime_imports_nothing_from_the_tests():
    """The CPU emulator (tests/support/cuda_emu.py) and the NumPy references (tests/support/references) serve the
    tests only: no runtime module imports them (the emulator is installed from outside through
    kernels_cuda.launch._backend_override)."""
    from_tests = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"references", "support"}
    for pkg in ("minirun", "kernels_cpu", "kernels_cuda"):
        for f in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    mods = [node.module]
                else:
                    continue
                for mod in mods:
                    assert mod.split(".")[0] not in from_tests, (str(f.relative_to(ROOT)), mod)
