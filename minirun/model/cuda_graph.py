"""Whole decode tokens replayed from CUDA graphs (EngineConfig.cuda_graphs): one launch per token.

Why: on an H100 an eager decode token of SmolLM2 is bound by the host, not the GPU: dense decode
ran 41-53 tok/s at 8K-32K and barely slowed with depth, ~10 ops per layer and token, each costing
the host tens of microseconds (docs/PROFILE.md). A graph replays all of a
token's kernels (torch's and kernels_cuda's, captured on the same stream) from one launch.

What makes a token capturable (Model.decode_at with the cache's attend_at and commit_at): no host
value inside it. The token id and its position are device tensors, copied in before each replay;
RoPE's angles are computed from the position on the device; the cache keeps whatever else it reads
per token in device memory (its graph_prepare writes it before the replay). Shapes depend on a
size the cache picks per step (graph_key): the dense cache writes k, v at the position
(index_copy_) and attends over the position + 1 rounded up to `bucket` slots, those past the
position masked; the HCA cache with the GPU value sum (kv/hca_graph.py) sizes its grids for the
store length rounded up to `bucket` and reads the live length from device memory. One graph per
size, captured when the context first reaches it. Weights, caches and these buffers keep their
addresses (the key includes any that could move), so graphs stay valid across truncate and reset.
A step the cache cannot capture (graph_key None: an HCA step in prefill mode, or before its codebooks
are fitted, say) runs eagerly.

A cache that cannot be captured (an HCA cache summing values on the host: its step waits for the
host) decodes eagerly.

On a CPU (or capture=False) the same steps run eagerly: what the tests compare with Engine.step.
"""
from __future__ import annotations

import sys
from collections import OrderedDict

import torch

BUCKET = 4096   # positions per graph: at most this many masked keys read per step
KEEP = 2        # graphs kept: the current bucket's and the one before (a rewind across a boundary)
WARMUPS = 2     # eager steps on a side stream before each capture (torch's recipe runs a few)


def supports(cache) -> bool:
    """Whether the cache's decode steps can be captured whole (the capture protocol of
    kv/base.KVCache: graph_capturable, graph_key, graph_prepare, attend_at, commit_at, graph_advance)."""
    return cache.graph_capturable()


def _graph_capture(run, pool, device, undo=None):
    """Warm `run` up on a side stream (lazy initialisation: cuBLAS, CuPy modules, kernel
    attributes: none of it may happen during a capture), calling undo() after each warm-up where
    run's writes are not idempotent; then capture one call of it into a new graph.
    -> (graph, run's outputs: static tensors the replays overwrite)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUPS):
            try:
                run()
            finally:   # (also when it raises: the eager step that follows must see the state before)
                if undo is not None:
                    undo()
    prev = torch.cuda.current_stream(device)
    prev.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = run()
    except RuntimeError:
        _abandon_capture(prev, pool, device)
        raise
    return graph, out


def _abandon_capture(prev, pool, device) -> None:
    """After a capture that failed: torch.cuda.graph's exit raises in capture_end before it restores
    the current stream and before the allocator leaves the capture's pool (torch/cuda/graphs.py),
    so do both here; the eager steps that follow then run as without graphs."""
    torch.cuda.set_stream(prev)
    torch.cuda.synchronize(device)
    end_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)   # (private; absent in some versions)
    if end_pool is not None:
        try:
            end_pool(device.index if device.index is not None else torch.cuda.current_device(), pool)
        except RuntimeError:
            pass


class GraphedDecode:
    """Decode steps of `model` over `cache` (offset = the position of the next token) from CUDA graphs.

    step(token) -> logits [1, V] float32 (a fresh tensor) and advances the cache by one, as
    model.forward does for one token. capture: None = on CUDA devices; False runs the captured
    code eagerly. `captures` counts graphs captured so far, `eager_steps` the steps the cache could
    not capture; after a capture that fails, `failed` holds why and every later step runs eagerly.
    """

    def __init__(self, model, cache, bucket: int = BUCKET, capture: bool | None = None):
        if not supports(cache):
            raise ValueError(f"{type(cache).__name__} cannot be captured whole (no attend_at, or not in this setting)")
        self.model, self.cache = model, cache
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.io = torch.zeros(2, dtype=torch.int64, device=model.device)    # token | position
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None   # shared by the graphs
        self.captures = 0
        self.failed: str | None = None
        self.bucket = int(bucket)
        self._graphs: OrderedDict = OrderedDict()   # key -> (graph, its static logits)
        self.eager_steps = 0

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        self._stage(token)
        sized = self.cache.graph_key(self.bucket)
        if sized is None:   # not capturable this step: the ordinary eager one
            self.eager_steps += 1
            return self.model.forward(self.io[:1].clone(), self.cache)
        key, nk = sized
        self.cache.graph_prepare()
        logits = self._replay(key, nk) if self.capture else self._run(nk)
        self.cache.graph_advance()
        return logits.clone() if self.capture else logits

    def _stage(self, token: int) -> int:
        """[token, position] into io (pageable: the host may reuse it) -> the position."""
        pos = self.cache.offset
        if pos >= self.cache.capacity:
            raise ValueError(f"position {pos} is past the cache's capacity {self.cache.capacity}")
        self.io.copy_(torch.tensor([token, pos], dtype=torch.int64))
        return pos

    def _give_up(self, e: Exception) -> None:
        """After a capture that failed: one note with its cause (not torch's generic "error during
        capture"); this and every later step run eagerly."""
        cause = e.__context__ or e
        self.failed = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        print(f"note: cuda graphs: capturing a decode step failed ({self.failed}); decoding without graphs",
              file=sys.stderr)
        self.capture = False

    def _run(self, nk: int) -> torch.Tensor:
        return self.model.decode_at(self.io[:1], self.io[1:], self.cache, nk)

    def _replay(self, key, nk: int) -> torch.Tensor:
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, nk)
            except RuntimeError as e:   # (a kernel or op that cannot be captured: keep decoding)
                self._give_up(e)
                self._graphs.clear()
                return self._run(nk)
        self._graphs.move_to_end(key)
        entry[0].replay()
        return entry[1]

    def _capture(self, key, nk: int):
        """One step's graph for this key. The warm-ups do this step's device work; the cache undoes
        what the replay could not redo (HCA: the eviction overwrites the ring slot it reads)."""
        snap = self.cache.graph_snapshot()
        graph, logits = _graph_capture(lambda: self._run(nk), self._pool, self.model.device,
                                       undo=lambda: self.cache.graph_restore(snap))
        self._graphs[key] = (graph, logits)
        self.captures += 1
        while len(self._graphs) > KEEP:
            self._graphs.popitem(last=False)
        return graph, logits
