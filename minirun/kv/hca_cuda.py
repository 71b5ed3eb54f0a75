"""HCACacheCUDA: the HCA cache with its device tier on the GPU (CuPy kernels) and values on the host.

Tested on an H100 (2026-11-24: the GPU tests against the CPU cache; kernels_cuda/README.md, "GPU
backend") and, everywhere, on the CPU with the kernel emulator (tests/support/cuda_emu.py), which runs the
same code with CPU tensors and no streams.

Where things live (CUDA device):
- device: sinks + ring (base class), key-store indices (or exact keys), codebooks, scratch z / sel;
  exact-mode prefill also keeps the store's values on the device until end_prefill (the exact
  prefill is dense attention anyway), anchor mode keeps the anchor block's values there;
- host: the value pool, page-locked and allocated once at capacity (minirun/kv/pinned.py says why),
  and small pinned staging buffers (the copied-back selection, the (o, m, l) stage).

One decode step of one layer (`_attend_hca`), in launch order on the current stream, every kernel
launched by kernels_cuda.decode.DecodeStep on buffers allocated once (no torch allocation, no
torch op on the device but the two copies):
  GPU: decode_prep (scaled query, far query, the new token's k, v into the exact tier's spare
       row, the selection histogram zeroed), build_lut, approx_scores (+ m, l), threshold_select
       (3 launches), pack_selection [counts | idx[:, :w] | z at idx] -> copied device->host
       (pinned), sel_event recorded
  GPU: attend_partial over sinks + ring + the new token (far positions: sinks apart, with the far
       query), partials into the merge's input                <- queued BEFORE the host waits
  host: sel_event.synchronize() (that copy only), wait for the last eviction copy's event,
       weighted_value_sum (Numba) of the copied scores (compact: no scatter) on the pinned pool,
       (o | m | l) into a pinned stage, copied host->device (non_blocking)
  GPU: lse_merge_staged of the device partials and the stage, written in the model's dtype.
What overlaps: the host value sum of layer l with the GPU's exact-tier attention of layer l and
with eviction copies on the copy stream. What cannot: layer l+1's projections need layer l's
attention output, so the GPU idles from the end of layer l's exact tier until the host sum is
back (the host sum is on the critical path once per layer); the host's enqueueing of layer l+1
also waits for it. The width w of the copy-back is a guess (grows to the next power of two >=
1.25 max(counts) when a step selects more; a wider second copy then fixes that step): one D2H
round trip per layer normally.

With the GPU value sum (EngineConfig.value_sum "gpu", the default where the device can read host
memory and a kv head has at most 8 query heads) the step has no host part: after the selection and
the exact tier, gather_value_sum (kernels_cuda/gather.cu) reads the selected rows from the value
pool itself -- the pool is page-locked *and mapped*, so a kernel reads it at its host address over
the bus -- and lse_merge_staged merges with an empty stage. No copy-back, no host sum, no host
wait: the host only queues launches, and a whole token is captured in one CUDA graph
(kv/hca_graph.py). On an H100 this decoded 1.7-2x faster than the host sum at 8K-1M of context
(docs/BENCHMARKS.md); the host sum stays for rescore (it scores the selected tokens from host
keys), for devices that cannot map host memory and for larger groups of query heads.

Kernel launches per decode token: tests/kv/test_hca_cuda.py counts them (decode_launches, held to the
emulator's launch log).
"""
from __future__ import annotations

import sys

import numpy as np
import torch

import kernels_cpu as kc
import kernels_cuda.decode as kcu_decode
import kernels_cuda.launch as kcu_launch

from ..errors import MiniRunError
from .hca_base import HCABase
from .hca_buffers import DeviceBuffers
from .hca_graph import CapturedSteps
from .hca_layout import resolve_layout
from .key_store_cuda import DeviceStore, device_codebooks, device_key_stores

INITIAL_WIDTH = 1024   # selected tokens per head copied back on the first try
VALUE_SUMS = ("host", "gpu")


def value_sum_choice(want: str, device: torch.device, rescore: bool, group: int) -> str:
    """EngineConfig.value_sum -> "host" | "gpu": auto is gpu unless rescore (its exact scores come
    from host keys), the query heads per kv head are not a group the gather takes (group 0:
    kernels_cuda.decode.group_size) or the device cannot read page-locked host memory at its
    address; gpu asked for where it cannot be: host, with a note."""
    if want == "host":
        return "host"
    why = ("rescore scores the selected tokens from the host's keys" if rescore else
           "the query heads per kv head are not a group of at most 8" if not group else
           "this device cannot read page-locked host memory at its address"
           if device.type == "cuda" and not kcu_decode.host_pool_readable(device) else None)
    if why and want == "gpu":
        print(f"note: value_sum gpu: {why}; summing values on the host", file=sys.stderr)
    return "host" if why else "gpu"


class HCACacheCUDA(CapturedSteps, HCABase):
    """The HCA cache with its device tier on a GPU; with the GPU value sum a whole decode token can
    run inside a CUDA graph (hca_graph.CapturedSteps)."""

    def __init__(self, args, config, device, dtype, capacity, model_dir=None):
        rescore = config.rescore and not resolve_layout(args, config).exact_keys
        value_sum = value_sum_choice(config.value_sum, device, rescore,
                                     kcu_decode.group_size(args.num_attention_heads, args.num_key_value_heads))
        gpu = device.type == "cuda"
        buffers = DeviceBuffers(device, torch.cuda.Stream(device) if gpu else None, value_sum == "gpu")
        super().__init__(args, config, device, dtype, capacity, buffers, model_dir)
        self._gpu, self._copy_stream, self.value_sum = gpu, buffers.copy_stream, value_sum
        self._ekx, self._evx = buffers.ekx, buffers.evx   # the exact tier with the decode token's spare row
        self.set_head_caps(self.head_caps)
        Hq, hd = self.Hq, self.hd
        self.q2k_dev = torch.as_tensor(self.q_to_kv).to(device)
        self.exact_store, self.key_store = device_key_stores(self.layout, Hq, self.Hkv, hd)
        self._width = INITIAL_WIDTH
        self.second_copies = 0                  # steps whose copy-back guess was too narrow
        self._pack_host = None                  # pinned int32, grows with the copy-back width
        self._stage_host = self._host_empty((Hq, hd + 2), torch.float32)   # the host part: o | m | l
        self._stage_np = self._stage_host.numpy()
        self._stage_dev = None
        self._sel_event = torch.cuda.Event() if self._gpu else None
        self._mask = self._mask_for = None      # _live_mask's buffer, and the state it holds
        self._ds = None                         # kernels_cuda.decode.DecodeStep, on the first decode step

    def _store_state(self) -> DeviceStore:
        """What the key stores read (key_store_cuda.DeviceStore); the codebooks moved to the device
        as the kernels read them, once, where there are codes."""
        C = None
        if self.codebooks is not None and not self.layout.exact_keys:
            self.codebooks = device_codebooks(self.codebooks, self.device)
            C = self.codebooks.centroids
        return DeviceStore(self.exact_keys, self.exact_base, self.n_encoded, self.indices, self.q2k_dev, C)

    def _encode(self, K: torch.Tensor) -> torch.Tensor:
        """K [L, Hkv, m, hd] on the device -> indices [L, Hkv, m, g], one launch for all layers."""
        return self.key_store.encode(K, self._store_state().centroids)

    def _histogram_cut(self, n: int = 2**31 - 1) -> bool:
        """Whether a selection over n store tokens cuts a histogram (kernels_cuda select_mode 0):
        then decode_prep zeroes the histograms first."""
        return self.head_caps is not None or kcu_launch.select_mode(self.tau, self.max_select, n) == 0

    def set_value_sum(self, choice: str) -> None:
        """Switch where later decode steps sum the selected values (VALUE_SUMS) on a filled cache, so
        one prefill serves an A/B of both (scripts/bench_gpu.py). The GPU sum needs the pool mapped
        (a cache made with it) and no host keys."""
        if choice not in VALUE_SUMS:
            raise MiniRunError(f"value sum {choice!r}: expected one of {', '.join(VALUE_SUMS)}")
        if choice == "gpu" and (not self.values.mapped or self.rescoring.on):
            raise MiniRunError("value sum gpu: the value pool is not mapped for the GPU"
                               + (" (rescore sums on the host)" if self.rescoring.on else ""))
        self.value_sum = choice

    def _host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=self._gpu)

    # ---- attention ----------------------------------------------------------------------------
    def _attend_hca(self, layer, q, k, v):
        """One token in hca mode with a store (a short ring: its dead slots masked): q [1, Hq, hd],
        k, v [1, Hkv, hd] (model dtype) -> [1, Hq, hd] (model dtype); None for several queries."""
        if q.shape[0] != 1:
            return None
        ds = self._decode_kernels()
        S, W = self.S, self.W
        self.positions.upload_turn(ds.cs, self.offset, self._gpu)   # (what decode_prep turns the far query by)
        with ds.session() as L:
            qs, qf = ds.prep(L, q[0], k[0], v[0], self._q_scale(1), self._ekx[layer, :, S + W],
                             self._evx[layer, :, S + W], self.positions.far, self._histogram_cut(self.n_store))
            if self.value_sum == "gpu" and self._pool_mapped():
                return self._gathered_step(L, ds, layer, qs, qf, q.dtype)
            sel = self._select(L, ds, layer, qf)                              # GPU + async D2H
            # queued before the host waits: the GPU runs these while the host sums values
            P = self._exact_parts(L, ds, layer, qs, qf)
            stage = self._host_sum(L, ds, layer, *sel, out=self._stage_dev)
            o = ds.merge(L, P, stage)
        return (o if o.dtype == q.dtype else o.to(q.dtype))[None]

    def _pool_mapped(self) -> bool:
        """Whether the GPU can read the pool (registered mapped); if not, value_sum becomes host."""
        if not self.values.mapped:
            print("note: value_sum gpu: the value pool could not be mapped for the GPU; summing values on the host",
                  file=sys.stderr)
            self.value_sum = "host"
        return self.values.mapped

    def _gathered_step(self, L, ds, layer, qs, qf, dtype):
        """The step's rest with the GPU summing the selected values itself (value_sum "gpu"),
        eagerly: _gpu_sum_launches over the whole store, nothing waited for on the host."""
        o = self._gpu_sum_launches(L, ds, layer, qs, qf, self.n_store, False)
        if self.record_selection is not None:                         # (a probe: this one syncs)
            cap = self._gather_cap() or 2**31 - 1
            self.record_selection.append(np.minimum(ds.counts.cpu().numpy(), cap) / self.n_store)
        return (o if o.dtype == dtype else o.to(dtype))[None]

    def _gpu_sum_launches(self, L, ds, layer, qs, qf, n: int, valid, n_live=None):
        """The launches of a step whose selected values the GPU sums from the mapped host pool, the
        one sequence an eager step (_gathered_step) and a captured one (attend_at) run: scores of the
        store's first n tokens for the far query qf, the selection (tau, the cap or per-head caps),
        sinks + ring (_exact_parts' valid), the gather, the merge -> o [Hq, hd] f32.
        n_live: int32 [1] on the device, the store's length a captured step reads (n: its grids)."""
        zb, idx = self.z.data[..., 0], self.sel.data[..., 0]
        store = self.key_store if self.n_encoded or n_live is not None else self.exact_store
        store.score(ds, L, layer, qf, zb, n, self._store_state(), n_live)
        cap = self._gather_cap()
        ds.select(L, zb, n, self.tau, idx, cap, n_live=n_live, caps=self.device_caps(layer))
        P = self._exact_parts(L, ds, layer, qs, qf, valid)
        if n_live is None:
            self.values.device_wait()     # the eviction copies, on the GPU (a graph's own launches wrote its rows)
        P = ds.gather(L, idx, zb, n, cap, self.values.data[layer], P)
        return ds.merge(L, P, ds.no_stage)

    def _gather_cap(self) -> int:
        """The one cap of _gpu_sum_launches' selection: max_select where no per-head caps replace
        it, else 0 (none). A cap >= n selects what no cap does: zcut keeps every bin, gather takes
        them all, so it need not depend on n (a captured step's n is its grids' bound)."""
        return self.max_select or 0 if self.head_caps is None else 0

    def _decode_kernels(self):
        """The DecodeStep (persistent buffers of the decode launches), made on first use."""
        if self._ds is None:
            self._ds = kcu_decode.DecodeStep(self.device, self.Hq, self.Hkv, self.hd, self.values.max_cap,
                                             self.S + self.W + 1, self.dtype)
            self._stage_dev = torch.zeros(self.Hq, self.hd + 2, dtype=torch.float32, device=self.device)
        return self._ds

    def _exact_parts(self, L, ds, layer, q, qf, valid=False) -> int:
        """attend over sinks + ring + the new token (the spare row prep wrote) into ds's partials;
        with far positions the sinks (unrotated) take the far query qf in a launch of their own.
        valid: the live-slot mask [S + W + 1] uint8 on the device, None (every slot live), or
        False: _live_mask's. Returns the number of partials."""
        if valid is False:
            valid = self._live_mask()
        S, W, ek, ev = self.S, self.W, self._ekx[layer], self._evx[layer]
        if not self.positions.far:   # (sinks read with the far query: a launch of their own)
            return ds.attend(L, q, ek, ev, self.q2k_dev, S + W + 1, valid, 0)
        P = ds.attend(L, q, ek[:, S:], ev[:, S:], self.q2k_dev, W + 1, None if valid is None else valid[S:], 0)
        return ds.attend(L, qf, ek, ev, self.q2k_dev, S, None if valid is None else valid[:S], P) if S else P

    def _live_mask(self, graph: bool = False):
        """The live sinks + ring slots (Ring.live_mask, kv/ring.py) plus the new token's spare row, uint8
        [S + W + 1] in one device buffer (at a fixed address: a captured step reads it), rewritten
        only when the state it shows changed (one small host->device copy a step while the ring is
        short). None while the ring is full, except for a graph, which always reads it (all ones)."""
        valid = self.ring.live_mask(self.offset, self.n_store)
        if valid is None and not graph:
            return None
        if self._mask is None:
            self._mask = torch.ones(self.S + self.W + 1, dtype=torch.uint8, device=self.device)
            self._mask_for = "full"
        state = "full" if valid is None else self.offset
        if self._mask_for != state:
            if valid is None:
                self._mask.fill_(1)
            else:
                self._mask[:-1].copy_(torch.from_numpy(valid))
            self._mask_for = state
        return self._mask

    def _attend_store_hca(self, layer, qs):
        """Several queries (prefill in hca mode, ring not full): one selection round trip each."""
        ds = self._decode_kernels()
        outs = []
        with ds.session() as L:
            for t in range(qs.shape[0]):
                q = qs[t].contiguous()
                if self._histogram_cut(self.n_store):
                    ds.hists.zero_()    # (a decode step's prep zeroes them; no prep here)
                stage = self._host_sum(L, ds, layer, *self._select(L, ds, layer, q))
                outs.append((stage[:, :self.hd], stage[:, self.hd], stage[:, self.hd + 1]))
        return tuple(torch.stack(x) for x in zip(*outs))

    def _select(self, L, ds, layer, q):
        """Launch scores + selection for one query [Hq, hd] f32; start the copy-back. Returns a handle."""
        zb, idx, n, cap = self._select_on_device(L, ds, layer, q)
        w = min(n, idx.shape[1], self._width)   # (idx: the [Hq, >= n] scratch, or [Hq, cap] when capped)
        self.rescoring.hold_query(q, self._gpu)   # (rescore: before the pack, which the host waits for)
        return (self._copy_back(L, ds, zb, idx, n, w, cap), w, zb, idx, n, cap)

    def _select_on_device(self, L, ds, layer, q):
        """Launch scores + selection for one query [Hq, hd] f32 -> (z [Hq, cap] scratch, idx rows,
        n, cap): counts in ds.counts, stats in ds.m / ds.l, each head's first min(counts, cap) idx."""
        n = self.n_store
        zb = self.z.data[..., 0]                                                  # [Hq, cap]
        (self.key_store if self.n_encoded else self.exact_store).score(ds, L, layer, q, zb, n, self._store_state())
        idx = self.sel.data[..., 0]
        cap = self.max_select if self.max_select and n > self.max_select and self.head_caps is None else 0
        ds.select(L, zb, n, self.tau, idx, cap, caps=self.device_caps(layer))   # (whole bins from the top, zcut)
        return zb, idx, n, cap or 2**31 - 1

    def set_head_caps(self, caps) -> None:
        """HCABase's, and their copy on the device (zcut reads its layer's row; a captured step too:
        graphs captured before a change read the new values, from the same buffer where the
        caps' presence did not change)."""
        had = getattr(self, "_caps_dev", None)
        super().set_head_caps(caps)
        if self.head_caps is None:
            self._caps_dev = None
        elif had is not None:
            with torch.inference_mode():   # (the cache's tensors are inference tensors)
                had.copy_(torch.from_numpy(self.head_caps.astype(np.int32)))
        else:
            self._caps_dev = torch.from_numpy(self.head_caps.astype(np.int32)).to(self.device)

    def device_caps(self, layer: int):
        """The layer's per-head caps int32 [Hq] on the device (head budgets), or None."""
        return None if self._caps_dev is None else self._caps_dev[layer]

    def _copy_back(self, L, ds, zb, idx, n, w, cap):
        """pack [counts | idx[:, :w] | z at those idx] (each block whole: the host sum reads idx and z
        as contiguous [Hq, w] arrays, no copy) -> pinned host buffer, on the compute stream (what
        runs after it, the exact tier, does not need it; the host waits for this copy only)."""
        pack = ds.pack_selection(L, idx, zb, n, w, cap)
        if self._pack_host is None or self._pack_host.numel() < pack.numel():
            self._pack_host = self._host_empty((pack.numel(),), torch.int32)
        host = self._pack_host[:pack.numel()]
        host.copy_(pack, non_blocking=self._gpu)
        if self._gpu:
            self._sel_event.record(torch.cuda.current_stream(self.device))
        return host

    def _host_sum(self, L, ds, layer, host, w, zb, idx, n, cap, out=None):
        """Wait for the copy-back only, sum the selected host values, send (o | m | l) [Hq, hd + 2]
        to the device (into `out`, else a new tensor)."""
        if self._gpu:
            self._sel_event.synchronize()
        Hq = self.Hq
        cnt = host[:Hq].numpy()
        cmax = int(cnt.max())
        if cmax > w:   # the guessed width was too small: a second, wide enough copy
            self.second_copies += 1
            self._width = 1 << int(cmax + cmax // 4).bit_length()       # > 1.25 cmax
            w = min(n, idx.shape[1], self._width)                        # >= cmax (cmax <= n, cap)
            host = self._copy_back(L, ds, zb, idx, n, w, cap)
            if self._gpu:
                self._sel_event.synchronize()
            cnt = host[:Hq].numpy()
        if self.record_selection is not None:
            self.record_selection.append(cnt / n)
        self.values.wait()                                        # eviction copies have landed
        hn = host.numpy()
        idx_h = hn[Hq:Hq + Hq * w].reshape(Hq, w)
        zs_h = hn[Hq + Hq * w:].view(np.float32).reshape(Hq, w)          # zs_h[h, t]: score of idx_h[h, t]
        V = self.values.data[layer].numpy()                       # [Hkv, cap, width], pinned
        self.rescoring.rescore(layer, idx_h, cnt, self.q_to_kv, zs_h)   # (rescore: exact scores replace the codebooks')
        o, m, l = kc.weighted_value_sum(zs_h, idx_h, cnt, V, self.q_to_kv, compact=True, head_dim=self.hd)
        # (the previous H2D from the stage is done: it was queued before the copy-back just waited for)
        st = self._stage_np
        st[:, :self.hd], st[:, self.hd], st[:, self.hd + 1] = o, m, l
        dev = torch.empty_like(self._stage_host, device=self.device) if out is None else out
        dev.copy_(self._stage_host, non_blocking=self._gpu)       # on the current stream
        return dev

    # ---- moving tokens between tiers ----------------------------------------------------------------
    def truncate(self, n: int) -> bool:
        self._mask_for = None
        return super().truncate(n)

    def reset(self) -> None:
        self.values.wait()
        self.rescoring.wait()
        self._mask_for = None
        super().reset()

    def stats(self) -> dict:
        s = super().stats()
        s.pop("total_bytes")
        s["device_ring_sinks_bytes"] = 2 * self._ekx.numel() * self._ekx.element_size()   # (+ the spare row)
        s["prefill_values_bytes"] = self.prefill_values.nbytes + (
            self.anchor_v.numel() * self.anchor_v.element_size() if self.anchor_v is not None else 0)
        pack = self._pack_host.numel() * 4 if self._pack_host is not None else 0
        s["host_scratch_bytes"] = pack + self._stage_host.numel() * 4
        s["total_bytes"] = sum(v for k, v in s.items() if k.endswith("_bytes"))
        s["value_sum"] = self.value_sum                           # where decode sums the values
        return s
