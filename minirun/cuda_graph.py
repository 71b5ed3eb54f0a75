"""Whole decode tokens replayed from CUDA graphs (`--cuda-graphs`): one launch per token.

Why: on the lent H100 a decode token of SmolLM2 was bound by the host, not the GPU: dense decode
ran 41-53 tok/s at 8K-32K and barely slowed with depth (docs/BENCHMARKS.md, twelfth session),
~10 ops per layer and token, each costing the host tens of microseconds. A graph replays all of a
token's kernels (torch's and kernels_cuda's, captured on the same stream) from one launch.

What makes a token capturable (Model.decode_at with the cache's attend_at): no host value inside
it. The token id and its position are device tensors, copied in before each replay; RoPE's angles
are computed from the position on the device; the cache writes k, v at that position (index_copy_)
and attends over a fixed number of slots n_keys, those past the position masked. Shapes depend on
n_keys alone: one graph per bucket of `bucket` positions (the position + 1 rounded up), captured
when the context first reaches it, so a step reads fewer than `bucket` masked keys more than it
needs. Weights, the cache and these buffers keep their addresses, so graphs stay valid across the
engine's truncate and reset.

Caches with attend_at: DenseCache. The HCA caches' decode steps still size their grids and read
n on the host (kernels_cuda/decode.py): not capturable yet.

On a CPU (or capture=False) the same step runs eagerly: what the tests compare with Engine.step.
"""
from __future__ import annotations

import sys
from collections import OrderedDict

import torch

BUCKET = 4096   # positions per graph: at most this many masked keys read per step
KEEP = 2        # graphs kept: the current bucket's and the one before (a rewind across a boundary)
WARMUPS = 2     # eager steps on a side stream before each capture (torch's recipe runs a few)


def supports(cache) -> bool:
    """Whether the cache's one-token attention can run inside a graph (it has attend_at)."""
    return callable(getattr(cache, "attend_at", None))


class GraphedDecode:
    """Decode steps of `model` over `cache` (offset = the position of the next token) from CUDA graphs.

    step(token) -> logits [1, V] float32 (a fresh tensor) and advances the cache by one, as
    model.forward does for one token. capture: None = on CUDA devices; False runs the captured
    code eagerly. `captures` counts graphs captured so far; after a capture that fails, `failed`
    holds why and every later step runs eagerly.
    """

    def __init__(self, model, cache, bucket: int = BUCKET, capture: bool | None = None):
        if not supports(cache):
            raise ValueError(f"{type(cache).__name__} has no attend_at: its decode steps cannot be captured")
        self.model, self.cache, self.bucket = model, cache, int(bucket)
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.io = torch.zeros(2, dtype=torch.int64, device=model.device)    # token | position
        self._graphs: OrderedDict = OrderedDict()   # n_keys -> (graph, its static logits)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None   # shared by the graphs
        self.captures = 0
        self.failed: str | None = None

    def n_keys(self, pos: int) -> int:
        """Slots the step at position pos attends over: pos + 1 rounded up to the bucket (<= capacity)."""
        return min(self.cache.capacity, (pos // self.bucket + 1) * self.bucket)

    def step(self, token: int) -> torch.Tensor:
        pos = self.cache.offset
        if pos >= self.cache.capacity:
            raise ValueError(f"position {pos} is past the cache's capacity {self.cache.capacity}")
        self.io.copy_(torch.tensor([token, pos], dtype=torch.int64))   # (pageable: the host may reuse it)
        nk = self.n_keys(pos)
        logits = self._replay(nk) if self.capture else self._run(nk)
        self.cache.advance(1)
        return logits.clone() if self.capture else logits

    def _run(self, nk: int) -> torch.Tensor:
        return self.model.decode_at(self.io[:1], self.io[1:], self.cache, nk)

    def _replay(self, nk: int) -> torch.Tensor:
        entry = self._graphs.get(nk)
        if entry is None:
            try:
                entry = self._capture(nk)
            except RuntimeError as e:   # (a kernel or op that cannot be captured: keep decoding)
                self.failed = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"note: --cuda-graphs: capturing a decode step failed ({self.failed}); decoding without "
                      "graphs", file=sys.stderr)
                self.capture = False
                self._graphs.clear()
                return self._run(nk)
        self._graphs.move_to_end(nk)
        entry[0].replay()
        return entry[1]

    def _capture(self, nk: int):
        """Warm up on a side stream (lazy initialisation: cuBLAS, CuPy modules, kernel attributes:
        none of it may happen during a capture), then capture one step into a new graph. Both
        runs write this position's k, v, as the replay that follows does again."""
        dev = self.model.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(WARMUPS):
                self._run(nk)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._run(nk)
        self._graphs[nk] = (graph, logits)
        self.captures += 1
        while len(self._graphs) > KEEP:
            self._graphs.popitem(last=False)
        return graph, logits
