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
on the cache's copy stream; `wait()` blocks the host on that copy's event only, `device_wait()`
makes the compute stream wait for it (a kernel reading the mapped pool). On a CPU device
(the emulator tests) the same class is a plain tensor with synchronous writes.
"""
from __future__ import annotations

import math

import torch

from .. import hugepages

_D2H = 2   # cudaMemcpyDeviceToHost
_PORTABLE, _MAPPED = 1, 2   # cudaHostRegister flags


class PinnedPool:
    def __init__(self, lead: tuple, width: int, dtype: torch.dtype, max_cap: int, device: torch.device,
                 copy_stream=None, mapped: bool = False):
        self.lead, self.width, self.dtype, self.max_cap, self.device = lead, width, dtype, max_cap, device
        self.copy_stream = copy_stream      # torch.cuda.Stream (CUDA) or None (CPU)
        self.data = None
        self.cap = 0
        self._registered = False
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False
        self.mapped = mapped     # kernels read the pool (asked for; False if the GPU would not map it)

    def reserve(self, n: int) -> None:
        if n <= self.cap:
            return
        if n > self.max_cap:
            raise ValueError(f"store overflow: {n} tokens > capacity {self.max_cap}")
        # huge pages (minirun.hugepages): the CPU's value sums gather scattered rows from it
        self.data = hugepages.empty(*self.lead, self.max_cap, self.width, dtype=self.dtype)
        self.cap = self.max_cap
        if self.device.type == "cuda" and self.data.numel():
            if self.mapped and not self._register_mapped():
                self.mapped = False
            if not self.mapped:
                rc = int(torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.nbytes, _PORTABLE))
                if rc != 0:
                    raise RuntimeError(f"cudaHostRegister of the {self.nbytes} B value pool failed (cudaError {rc})")
            self._registered = True

    def _register_mapped(self) -> bool:
        """Page-lock the pool portable | mapped (kernels read it: kernels_cuda.decode.gather_value_sum);
        False if CUDA refuses. Through CuPy: its errors reset CUDA's last-error state, so a refusal
        does not surface later in one of torch's launch checks (torch's cudart has no cudaGetLastError)."""
        import cupy
        with cupy.cuda.Device(self._device_index()):
            try:
                cupy.cuda.runtime.hostRegister(self.data.data_ptr(), self.nbytes, _PORTABLE | _MAPPED)
            except cupy.cuda.runtime.CUDARuntimeError:
                return False
        return True

    def write_all(self, j0: int, rows: torch.Tensor) -> None:
        """rows [*lead, m, width] (on the device) into token slots j0..j0+m of every leading index."""
        m = rows.shape[-2]
        if m == 0:
            return
        if self.device.type != "cuda":
            self.data[..., j0:j0 + m, :] = rows
            return
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

    def view(self, layer: int, n: int) -> torch.Tensor:
        return self.data[layer, :, :n]

    def token_rows(self, layer: int, n: int) -> torch.Tensor:
        return self.view(layer, n)

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

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()
