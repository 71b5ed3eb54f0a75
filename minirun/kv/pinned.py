"""Host value pool of the CUDA backend: page-locked memory, allocated once at capacity.

Why not `torch.empty(..., pin_memory=True)` grown like GrowingBuffer: torch's caching host
allocator rounds every pinned allocation up to a power of two (up to 2x the bytes, never
returned to the OS while the process lives), and growing a pinned pool copies it while async
device->host copies into the old block may still be in flight. So the pool is one plain CPU
allocation of the store's full capacity [*lead, max_cap, width], made when the first token is
stored (short contexts cost nothing), then page-locked with cudaHostRegister (exact bytes; the
same call torch.cuda._pin_memory_utils makes) and unregistered in `free`. `nbytes` is exactly
what is allocated and locked. Capacity is the engine's ctx minus sinks and ring, which is what
the planner budgets for the value pool anyway.

Writes (`write_all`) take device rows [*lead, m, width] and copy them with ONE strided async
copy (cudaMemcpy2DAsync: prod(lead) rows of m*width elements, destination pitch max_cap*width)
on the cache's copy stream, which `wait()` and `device_wait()` wait for. On a CPU device (the
emulator tests) the same class is a plain tensor with synchronous writes.
"""
from __future__ import annotations

import math

import torch

from .. import hugepages
from .store import GrowingBuffer

_D2H = 2   # cudaMemcpyDeviceToHost
_PORTABLE, _MAPPED = 1, 2   # cudaHostRegister flags


class PinnedPool(GrowingBuffer):
    """GrowingBuffer's interface, allocated at max_cap on the first reserve (see the module docstring)."""

    def __init__(self, lead: tuple, width: int, dtype: torch.dtype, max_cap: int, device: torch.device,
                 copy_stream=None, mapped: bool = False):
        super().__init__(lead, width, dtype, max_cap, device, at_capacity=True)
        self.copy_stream = copy_stream      # torch.cuda.Stream (CUDA) or None (CPU)
        self._registered = False
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False
        self.mapped = mapped     # kernels read the pool (asked for; False if the GPU would not map it)

    def _alloc(self, cap: int) -> torch.Tensor:
        """On the host (huge pages: the CPU's value sums gather scattered rows from it), page-locked
        with a GPU."""
        data = hugepages.empty(*self.lead, cap, self.width, dtype=self.dtype)
        if self.device.type == "cuda" and data.numel():
            nbytes = data.numel() * data.element_size()
            if self.mapped and not self._register_mapped(data, nbytes):
                self.mapped = False
            if not self.mapped:
                rc = int(torch.cuda.cudart().cudaHostRegister(data.data_ptr(), nbytes, _PORTABLE))
                if rc != 0:
                    raise RuntimeError(f"cudaHostRegister of the {nbytes} B value pool failed (cudaError {rc})")
            self._registered = True
        return data

    def _register_mapped(self, data: torch.Tensor, nbytes: int) -> bool:
        """Page-lock the pool portable | mapped (kernels read it: kernels_cuda.decode.gather_value_sum);
        False if CUDA refuses. Through CuPy: its errors reset CUDA's last-error state, so a refusal
        does not surface later in one of torch's launch checks (torch's cudart has no cudaGetLastError)."""
        import cupy
        with cupy.cuda.Device(self._device_index()):
            try:
                cupy.cuda.runtime.hostRegister(data.data_ptr(), nbytes, _PORTABLE | _MAPPED)
            except cupy.cuda.runtime.CUDARuntimeError:
                return False
        return True

    def write_all(self, j0: int, rows: torch.Tensor) -> None:
        """rows [*lead, m, width] (on the device) into token slots j0..j0+m of every leading index."""
        m = rows.shape[-2]
        if m == 0:
            return
        if self.device.type != "cuda":
            return super().write_all(j0, rows)
        import cupy
        cur = torch.cuda.current_stream(self.device)
        src = rows.to(self.dtype).contiguous()          # on the current stream
        self.copy_stream.wait_stream(cur)               # the copy starts after src is written
        src.record_stream(self.copy_stream)             # src's memory is not reused before the copy ran
        esz = self.data.element_size()
        rows_n = math.prod(self.lead)
        dst = self.data.data_ptr() + j0 * self.width * esz
        with cupy.cuda.Device(self._device_index()):
            cupy.cuda.runtime.memcpy2DAsync(dst, self.max_cap * self.width * esz, src.data_ptr(), m * self.width * esz,
                                            m * self.width * esz, rows_n, _D2H, self.copy_stream.cuda_stream)
        self._event.record(self.copy_stream)
        self._pending = True

    def _device_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def wait(self) -> None:
        """Block the host until the last write_all landed (that copy's event only)."""
        if self._pending:
            self._event.synchronize()
            self._pending = False

    def device_wait(self) -> None:
        """Make the current stream wait (on the GPU, not the host) for the last write_all, before a
        kernel reads the pool."""
        if self._pending:
            torch.cuda.current_stream(self.device).wait_event(self._event)

    def free(self) -> None:
        self.wait()
        if self._registered:
            if self.mapped:   # a kernel queued on any stream may still read it
                torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self._registered = False
        self.data, self.cap = None, 0

    def __del__(self):
        try:
            if self._registered:
                self.free()
        except Exception:
            pass
