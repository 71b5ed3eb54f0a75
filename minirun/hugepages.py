"""Transparent huge pages for the large CPU buffers a decode step streams or gathers from.

On Linux with transparent huge pages in "madvise" mode (the default of many distributions), anonymous memory gets 2 MiB pages only where madvise(MADV_HUGEPAGE) asked for them.
The decode step reads every layer's weights, the dense K/V, the HCA index store once per token,
and gathers scattered 256-byte value rows from the HCA value pool: with 4 KiB pages the gather
misses the TLB on most rows (a page walk, doubled under a hypervisor). On a 2-core Zen 4 machine,
dense decode at 16K went from 55-61 to 50.5-51.6 ms per token.

The advice has to come before the pages are first touched (already-present 4 KiB pages are only
merged later by a background thread), so buffers are made here empty, advised, then filled.
torch's own switch (the THP_MEM_ALLOC_ENABLE environment variable) does the same for every
allocation of >= 2 MiB, but only when set before torch's first allocation in the process, which
a library imported after torch cannot ensure. Elsewhere (other systems, THP "never") these are
plain torch.empty / zeros / clone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def advise(t: torch.Tensor) -> bool:
    """Ask for 2 MiB pages over the whole 2 MiB pages inside t's memory (CPU, Linux). Only pages not
    yet touched are affected. -> whether the advice was given (False: too small, not a CPU tensor,
    not Linux, or the kernel refused)."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = t.data_ptr()
    lo = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    hi = (start + t.numel() * t.element_size()) & ~(HUGE_PAGE - 1)
    if hi <= lo:
        return False
    try:
        return _madvise()(lo, hi - lo, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def empty(*shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """torch.empty(shape), on huge pages where the OS gives them (CPU)."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    advise(t)
    return t


def zeros(*shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """torch.zeros(shape), on huge pages where the OS gives them (CPU)."""
    return empty(*shape, dtype=dtype, device=device).zero_()


def clone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t, on huge pages where the OS gives them (CPU); other devices: t itself."""
    if t.device.type != "cpu":
        return t
    out = empty(*t.shape, dtype=t.dtype)
    out.copy_(t)
    return out
