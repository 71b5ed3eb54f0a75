"""CPU emulation backend for kernels_cuda, for the tests.

Compiles a kernels_cuda .cu file with g++ and ``cuda_emu_prelude.cuh`` (fiber-based
SIMT emulator, see that file) and runs the *unchanged* wrappers of
:mod:`kernels_cuda.ops` on CPU torch tensors:

    import cuda_emu
    from kernels_cuda import ops
    with cuda_emu.emulated(order="reverse"):
        z, (m, l) = ops.approx_scores(T_cpu, P_cpu, q2k_cpu, n)

On top of the emulator's own checks (deadlock, divergent barriers, shuffles
after exits, shared-memory overflow), every launch checks each argument
against the kernel's C signature (pointer element type vs tensor dtype,
``int`` / ``long long`` / ``float`` vs np.int32 / np.int64 / np.float32), that
no non-const (output) pointer aliases another pointer argument (they are all
``__restrict__``), and runs the kernel on guarded copies of the tensors:
4 KiB of 0xff bytes before (checked after the launch for out-of-bounds writes)
and a PROT_NONE page right after each tensor's last byte (reads or writes past
the end fault and fail the launch); const inputs are checked unchanged; outputs
are copied back.  Wrapper allocations (backend ``empty``)
are filled with 0xff so that entries a kernel should write but does not
surface as NaN / -1.

The runtime never imports it (it installs itself as kernels_cuda.launch._backend_override).
Scripts that rehearse on the CPU put tests/ on sys.path.  Needs g++ (C++17) and glibc ucontext.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from kernels_cuda import _sources, launch

PRELUDE = Path(__file__).with_name("cuda_emu_prelude.cuh")
GUARD = 4096
_ORDERS = {"forward": 0, "reverse": 1, "random": 2, "greedy": 3, "greedy_reverse": 4}

_SIG_RE = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?(\w+)\s*\(([^)]*)\)', re.S
)


def gxx() -> str | None:
    return shutil.which("g++")


_SIGNATURES: dict[str, dict] = {}


def signatures(file: str) -> dict[str, list[tuple[str, bool, str]]]:
    """kernel name -> [(base type, is_pointer, is_const)] parsed from the source (once per file: each
    launch checks its arguments against them, and parsing took a tenth of an emulated decode step)."""
    if file in _SIGNATURES:
        return _SIGNATURES[file]
    out = {}
    for mo in _SIG_RE.finditer(_sources.raw_text(file)):
        params = []
        for p in mo.group(2).split(","):
            p = " ".join(p.replace("__restrict__", " ").split())
            if not p:
                continue
            p = re.sub(r"\s*\w+$", "", p)  # drop the parameter name
            is_ptr = p.endswith("*")
            base = p.rstrip("*").strip()
            is_const = base.startswith("const ")
            if is_const:
                base = base[len("const ") :]
            params.append((base, is_ptr, is_const))
        out[mo.group(1)] = params
    _SIGNATURES[file] = out
    return out


def _launcher_code(file: str) -> str:
    lines = [f'#include "{(_sources.HERE / file).as_posix()}"', ""]
    for name, params in signatures(file).items():
        args = []
        for i, (base, is_ptr, is_const) in enumerate(params):
            t = f"{'const ' if is_const else ''}{base}{'*' if is_ptr else ''}"
            args.append(f"*({t}*)a[{i}]")
        lines.append(
            f'extern "C" int emu_launch_{name}(void** a, unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
            f"unsigned by, unsigned bz, unsigned long long smem, int order, unsigned seed) {{\n"
            f"    std::function<void()> body = [&]() {{ {name}({', '.join(args)}); }};\n"
            f"    return emu::launch(gx, gy, gz, bx, by, bz, smem, order, seed, body);\n}}"
        )
    lines.append('extern "C" const char* emu_error() { return emu::g.error.c_str(); }')
    return "\n".join(lines) + "\n"


_LIBS: dict[str, ctypes.CDLL] = {}


def build(file: str) -> ctypes.CDLL:
    """Compile (cached on disk by content hash) and load the emulated module."""
    if file in _LIBS:
        return _LIBS[file]
    cxx = gxx()
    if cxx is None:
        raise RuntimeError("g++ not found: the kernels_cuda CPU emulator needs it")
    code = _launcher_code(file)
    h = hashlib.sha256()
    for part in (code, PRELUDE.read_text(), _sources.source(file)):
        h.update(part.encode())
    cache = Path(tempfile.gettempdir()) / f"minirun_kernels_emu_{os.getuid()}"
    cache.mkdir(exist_ok=True)
    so = cache / f"{Path(file).stem}_{h.hexdigest()[:16]}.so"
    if not so.exists():
        src = cache / f"{so.stem}.cpp"
        src.write_text(code)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        cmd = [
            cxx, "-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-fno-strict-aliasing", "-ffp-contract=off",
            "-Wall", "-Wno-unused-variable", "-Wno-unused-function", "-include", str(PRELUDE), "-x", "c++",
            str(src), "-o", str(tmp),
        ]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"emulator build of {file} failed:\n{res.stderr[-6000:]}")
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.emu_error.restype = ctypes.c_char_p
    _LIBS[file] = lib
    return lib


# ---------------------------------------------------------------------------
# Backend with the interface of kernels_cuda.launch._CupyBackend
# ---------------------------------------------------------------------------

_PTR_DTYPES = {
    "float": ("float32",),
    "int": ("int32",),
    "long long": ("int64",),
    "unsigned char": ("uint8",),
    "short": ("int16",),
    "unsigned short": ("float16", "bfloat16", "int16"),
}
_SCALARS = {"int": (np.int32, ctypes.c_int32), "long long": (np.int64, ctypes.c_int64), "float": (np.float32, ctypes.c_float)}


def _extent_bytes(t) -> int:
    if t.numel() == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PROT_NONE, _PROT_RW = 0, 3
_MAP_PRIVATE, _MAP_ANONYMOUS = 0x02, 0x20


class _Guarded:
    """A guarded host copy of a tensor's bytes: GUARD bytes of 0xff before it (checked
    for writes) and a PROT_NONE page right after its last byte (any read or write
    past the end faults; the emulator turns the fault into a launch error).  The
    copy is 16-byte aligned whenever its size is a multiple of 16 (the wrappers pick
    16-byte vector loads only for such tensors)."""

    def __init__(self, t):
        self.t = t
        self.nbytes = _extent_bytes(t)
        pages = -(-(GUARD + self.nbytes + 16) // _PAGE)
        self.size = (pages + 1) * _PAGE
        base = _libc.mmap(None, self.size, _PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        self.base = base
        end = base + pages * _PAGE
        self.ptr = end - self.nbytes
        ctypes.memset(base, 0xFF, pages * _PAGE)
        ctypes.memmove(self.ptr, t.data_ptr(), self.nbytes)
        if _libc.mprotect(end, _PAGE, _PROT_NONE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")
        self.orig = ctypes.string_at(self.ptr, self.nbytes)

    def guards_ok(self) -> bool:
        return ctypes.string_at(self.ptr - GUARD, GUARD) == b"\xff" * GUARD

    def unchanged(self) -> bool:
        return ctypes.string_at(self.ptr, self.nbytes) == self.orig

    def copy_back(self):
        ctypes.memmove(self.t.data_ptr(), self.ptr, self.nbytes)

    def free(self):
        if self.base is not None:
            _libc.munmap(self.base, self.size)
            self.base = None

    def __del__(self):
        self.free()


class EmuBackend:
    name = "emu"

    def __init__(self, order="forward", num_sms=4, smem_optin=227 * 1024, seed=1):
        self.order = _ORDERS[order]
        self.num_sms = num_sms
        self.smem_optin = smem_optin
        self.seed = seed
        self.launches: list[tuple[str, tuple, tuple, int]] = []  # (kernel, grid, block, smem) log

    def check_tensor(self, t, what):
        if t.device.type != "cpu":
            raise ValueError(f"{what} must be a CPU tensor under the emulator (got {t.device})")

    def device_info(self, device):
        return self.num_sms, self.smem_optin

    def empty(self, shape, dtype, device):
        import torch

        t = torch.empty(shape, dtype=dtype, device=device)
        if t.numel():
            t.view(-1).view(torch.uint8).fill_(0xFF)
        return t

    @contextlib.contextmanager
    def session(self, device):
        yield self

    def launch(self, file, name, grid, block, args, shared_mem=0):
        import torch

        sig = signatures(file).get(name)
        if sig is None:
            raise KeyError(f"{name} is not an extern \"C\" __global__ function of {file}")
        if len(sig) != len(args):
            raise TypeError(f"{name}: {len(args)} arguments for {len(sig)} parameters")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        holders, ptrs, guarded = [], [], []
        for i, ((base, is_ptr, is_const), a) in enumerate(zip(sig, args)):
            if is_ptr:
                if not isinstance(a, torch.Tensor):
                    raise TypeError(f"{name} arg {i}: expected a tensor for {base}*, got {type(a).__name__}")
                if str(a.dtype).replace("torch.", "") not in _PTR_DTYPES[base]:
                    raise TypeError(f"{name} arg {i}: {base}* does not match tensor dtype {a.dtype}")
                self.check_tensor(a, f"{name} arg {i}")
                gd = _Guarded(a)
                guarded.append((i, is_const, gd))
                v = ctypes.c_void_p(gd.ptr)
            else:
                want, ct = _SCALARS[base]
                if type(a) is not want:
                    raise TypeError(f"{name} arg {i}: {base} needs {want.__name__}, got {type(a).__name__}")
                v = ct(a.item())
            holders.append(v)
            ptrs.append(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p))
        # __restrict__: an output may not overlap any other pointer argument.
        spans = [(i, c, g.t.data_ptr(), g.t.data_ptr() + g.nbytes) for i, c, g in guarded if g.nbytes]
        for i, ci, lo_i, hi_i in spans:
            for j, cj, lo_j, hi_j in spans:
                if i < j and (not ci or not cj) and lo_i < hi_j and lo_j < hi_i:
                    raise ValueError(f"{name}: pointer args {i} and {j} overlap (__restrict__ violated)")
        self.launches.append((name, grid, block, int(shared_mem)))
        try:
            lib = build(file)
            fn = getattr(lib, f"emu_launch_{name}")
            fn.restype = ctypes.c_int
            argv = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
            rc = fn(argv, *[ctypes.c_uint(x) for x in grid], *[ctypes.c_uint(x) for x in block],
                    ctypes.c_ulonglong(int(shared_mem)), ctypes.c_int(self.order), ctypes.c_uint(self.seed))  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"emulated {name}: {lib.emu_error().decode()}")
            for i, is_const, gd in guarded:
                if not gd.guards_ok():
                    raise RuntimeError(f"emulated {name}: out-of-bounds write before pointer arg {i}")
                if is_const:
                    if not gd.unchanged():
                        raise RuntimeError(f"emulated {name}: const pointer arg {i} was modified")
                else:
                    gd.copy_back()
        finally:
            for _, _, gd in guarded:
                gd.free()


@contextlib.contextmanager
def emulated(**kw):
    """Route kernels_cuda launches (ops, decode, layer) to the CPU emulator inside the block."""
    be = EmuBackend(**kw)
    prev, launch._backend_override = launch._backend_override, be
    try:
        yield be
    finally:
        launch._backend_override = prev


@contextlib.contextmanager
def hca_cuda_caches():
    """Engines made inside (minirun.engine.make_cache) get HCA caches of the GPU class,
    kv/hca_cuda.HCACacheCUDA, on the CPU: run them inside emulated(). Dense engines stay dense."""
    import minirun.engine as me
    from minirun.kv.hca_cuda import HCACacheCUDA

    orig = me.make_cache

    def make(args, config, device, dtype, capacity, model_dir=None):
        if config.kv != "hca":
            return orig(args, config, device, dtype, capacity, model_dir=model_dir)
        return HCACacheCUDA(args, config, device, dtype, capacity, model_dir)
    me.make_cache = make
    try:
        yield
    finally:
        me.make_cache = orig


@contextlib.contextmanager
def emulated_hca_cuda(**kw):
    """emulated(**kw) with hca_cuda_caches(): the GPU cache's whole decode path on the CPU."""
    with emulated(**kw) as be, hca_cuda_caches():
        yield be
