"""The HCAttention cache: sinks + ring exact, older keys as codebook indices, older values on the host.

Tiers and invariants (tested in tests/test_hca_cache.py):
- every position in [0, offset) lives in exactly one tier: sinks [0, S), store [S, S + n_store),
  ring [S + n_store, offset) with at most W tokens; keys are stored post-RoPE, so each keeps its position;
- ring slot of position p >= S is S + (p - S) % W; `slot_pos` records which position each slot holds;
- `attend` never mutates: it stages the chunk's k, v; `advance` moves tokens between tiers.
Each query head selects its own set of store tokens (softmax mass >= tau over approximate scores);
values are shared within a kv-head group. The exact part and the approximate part merge by
log-sum-exp, exactly.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import torch

import kernels_cpu as kc
from kernels_cpu import fastscan as fs

from .. import hugepages
from .attention import merge, partial_attention
from .base import KVCache
from .hca_cpu_step import OneCallSteps
from .codebooks import Codebooks, codebook_filename
from .far_positions import FarFrame, default_far_distance, far_group, far_positions_on
from .hca_layout import HCALayout, fast_scan, resolve_layout
from .ring_checkpoint import RingCheckpoint
from .select_cap import cap_selection
from .store import ColumnBuffer, GrowingBuffer



class HCACache(OneCallSteps, KVCache):
    """See the module docstring. CPU backend: torch for the exact part, Numba kernels for the rest."""
    uses_levels = True    # keeps the level scratch of the CPU selection (kernels_cpu.level_select)

    def __init__(self, args, layout: HCALayout, capacity: int, sinks: int, window: int, tau: float,
                 dtype: torch.dtype, device: torch.device, codebooks: Codebooks | None = None,
                 fit_min_tokens: int = 4096, anchor_tokens: int = 2048, far_positions: bool = False,
                 far_distance: int | None = None, max_select: int | None = None, length_ctx: int | None = None,
                 far_group: int = 0, rescore: bool = False):
        super().__init__(args.num_hidden_layers, capacity)
        L, Hkv, hd = args.num_hidden_layers, args.num_key_value_heads, args.head_dim
        self.Hq, self.Hkv, self.hd = args.num_attention_heads, Hkv, hd
        self.layout, self.tau, self.dtype, self.device = layout, tau, dtype, device
        self.max_select = max_select   # top tokens per head and step at most (kv/select_cap.py); None: tau alone
        self.S, self.W = sinks, window
        self.scale = 1.0 / math.sqrt(hd)
        self.length_ctx = length_ctx   # length scaling on: the trained context N (see _q_scale); None: off
        # far positions (kv/far_positions.py): sinks and store keys kept unrotated, read at distance D
        self.far = FarFrame(args, far_distance or window, far_group, window) if far_positions else None
        self.q_to_kv = np.arange(self.Hq, dtype=np.int32) // (self.Hq // Hkv)
        self._lanes = kc.lane_map(self.q_to_kv, Hkv)               # query heads in the packed tables' lanes
        self._counts = np.zeros(self.Hq, np.int32)                 # selection sizes of the last step
        # exact tier: sinks then ring slots, and the position held by each slot (-1 = empty)
        self.ek = hugepages.zeros(L, Hkv, sinks + window, hd, dtype=self.exact_tier_dtype(dtype, device), device=device)
        self.ev = hugepages.zeros(*self.ek.shape, dtype=self.ek.dtype, device=device)
        self.slot_pos = torch.full((sinks + window,), -1, dtype=torch.long)
        # numpy views of the exact tier for the decode fast path (float32/float16 on the CPU only)
        self._numpy_exact_tier = device.type == "cpu" and self.ek.dtype in (torch.float32, torch.float16)
        self._ek_np = self.ek.numpy() if self._numpy_exact_tier else None
        self._ev_np = self.ev.numpy() if self._numpy_exact_tier else None
        store_cap = max(0, capacity - sinks - window)
        vdt = torch.float32 if dtype == torch.float32 else torch.float16
        self.values = GrowingBuffer((L, Hkv), hd, vdt, store_cap)                    # host tier
        # rescore: the store's keys in full precision on the host too (as the codebooks encoded them),
        # so that the selected tokens are weighted by exact scores (kernels_cpu.rescore); an
        # exact-key store has them already
        self.host_keys = GrowingBuffer((L, Hkv), hd, vdt, store_cap) if rescore and not layout.exact_keys else None
        idx_dt = torch.uint8 if layout.index_bytes == 1 else torch.int16
        # group-major [L, Hkv, g, cap]: the scoring kernel's layout (kernels_cpu.packed)
        self.indices = None if layout.exact_keys else ColumnBuffer((L, Hkv), layout.groups, idx_dt, store_cap)
        # full-precision store keys: permanent with exact_keys, else only while codebooks are
        # missing or an exact prefill runs; they cover store positions [exact_base, n_store)
        self.exact_keys = GrowingBuffer((L, Hkv), hd, torch.float32, store_cap)
        self.exact_base = 0
        self.n_store = 0          # tokens in the store (all layers)
        self.n_encoded = 0        # store tokens [0, n_encoded) have codebook indices
        self.codebooks = codebooks
        self._cnorm = None        # (codebooks, their ||c||^2) for the encode kernel
        # decode steps encode the ring's oldest key (the next to leave) inside each layer's fused
        # call, where the codebooks are in cache: codes [L, Hkv, 1, g] for position _pending_pos
        self._pending = None
        self._pending_pos = -1
        self._pending_done = np.zeros(L, bool)
        self._cbt = None          # (codebooks, their [L, Hkv, g, ds, c] layout) for the LUT kernel
        self._lut = None          # [Hq, g, c] scratch lookup table
        self._hist = None         # level-bucket counts of the selection (kc.level_hist)
        self._views = {}          # layer -> (buffer addresses, numpy views) for the decode kernel
        self._live_slots = None   # uint8 mask of the live exact-tier slots while the ring is short
        self._packed = None       # its packed integer form (kc.PackedLUT of scratch arrays)
        # nibble pairs (layout.pairs): (codebooks, factors transposed, their norms), the fast-scan scratch
        self._fast_scan = fast_scan(layout) and device.type == "cpu"
        self._fs = None
        self._fs_lut = None
        self.fit_min_tokens = fit_min_tokens   # no codebooks: fit once this many keys left the ring
        self.mode = "hca"         # "hca" | "exact" | "anchor": how a prefill chunk attends to the store
        # anchor prefill (paper App. B): exact copies of the store's first keys, during prefill only
        self.anchor_tokens = anchor_tokens
        self.anchor_k = None      # [L, Hkv, anchor_tokens - S, hd] float32
        self.z = GrowingBuffer((self.Hq,), 1, torch.float32, store_cap)             # scratch scores
        self.sel = GrowingBuffer((self.Hq,), 1, torch.int32, store_cap)             # scratch selection
        # the selection's integer score levels (uint16 bits; a CPU-only scratch: kernels_cpu.level_select)
        self.lev = GrowingBuffer((self.Hq,), 1, torch.int16, store_cap) if self.uses_levels else None
        self._staged: list = [None] * L
        # copies of sinks + ring by name ("prompt", "shared": Engine.prefill), so that truncate can go
        # back past the ring (kv/ring_checkpoint.py)
        self.rewind_points = {"prompt": RingCheckpoint(), "shared": RingCheckpoint()}
        self.notes: list[str] = []
        # when a list: each one-token step appends, per layer, the fraction of the store each
        # query head selected (float64 [Hq]); the quality tools read it (evaluate.selection_probe)
        self.record_selection: list | None = None

    @staticmethod
    def exact_tier_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The sinks + ring dtype: the compute dtype, except bfloat16 on the CPU, which is held as
        float16 (the same bytes, so the planner's figures stand) because the Numba decode step
        reads float32 or float16 only; float16 holds every bfloat16 value exactly between 6e-5 and
        65504 (keys and values live well inside), like the host value pool of bfloat16 runs."""
        return torch.float16 if device.type == "cpu" and dtype == torch.bfloat16 else dtype

    @classmethod
    def create(cls, args, config, device, dtype, capacity, model_dir=None) -> "HCACache":
        layout = resolve_layout(args, config)
        codebooks = None
        geometry = layout.codebook_geometry
        far = far_positions_on(config.far_positions, args.max_position_embeddings, capacity)
        dist = config.far_distance or default_far_distance(config.window, args.max_position_embeddings)
        group = far_group(capacity, config.window, args.max_position_embeddings) if config.far_positions == "grouped" else 0
        # far positions store keys unrotated: their codebooks are calibrated on unrotated keys (grouped
        # ones hold them rotated, at j // G: the ordinary calibration's)
        unrotated = far and not group
        if not layout.exact_keys and model_dir is not None:
            path = model_dir / codebook_filename(*geometry[:2], unrotated=unrotated)
            if path.is_file():
                codebooks = Codebooks.load(path, (args.num_hidden_layers, args.num_key_value_heads, *geometry))
                codebooks = codebooks.paired() if layout.pairs else codebooks
        trained = args.max_position_embeddings
        length_ctx = trained if far_positions_on(config.length_scale, trained, capacity) else None
        cache = cls(args, layout, capacity, config.sinks, config.window, config.tau, dtype, device, codebooks,
                    fit_min_tokens=config.fit_min_tokens, anchor_tokens=config.anchor_tokens, far_positions=far,
                    far_distance=dist, max_select=config.max_select, length_ctx=length_ctx, far_group=group,
                    rescore=config.rescore)
        if length_ctx:
            print(f"minirun: length scaling: attention logits x log(n) / log({trained}) past {trained} tokens "
                  f"(--length-scale {config.length_scale})", file=sys.stderr)
        if far:
            why = (f"--far-positions {config.far_positions}" if config.far_positions != "auto" else
                   f"the context passes the {args.max_position_embeddings} tokens the model was trained on")
            how = (f"at their distances divided by {group} (grouped)" if group else f"at distance {dist}")
            print(f"minirun: far positions: tokens older than the {config.window}-token window are attended "
                  f"{how} ({why})", file=sys.stderr)
        if far and config.rescore and not layout.exact_keys:
            print("minirun: note: --rescore with far positions: on SmolLM2 past its trained context it read no "
                  "better than the codebook weights (docs/QUALITY.md, \"Exact weights from host keys\")", file=sys.stderr)
        if not layout.exact_keys and codebooks is None:
            print(f"minirun: no {codebook_filename(*geometry[:2], unrotated=unrotated)} in the model directory: "
                  f"codebooks will be fitted from the prompt's own keys (run `minirun calibrate"
                  f"{' --unrotated' if unrotated else ''}` to make one)", file=sys.stderr)
        return cache

    def _q_scale(self, T: int) -> float:
        """The query scale of a step of T queries: 1/sqrt(hd), and with length scaling on times
        max(1, log n / log N), n = offset + T the tokens the step's last query sees, N the trained
        context. As n grows past N, more and more old tokens share one softmax (all of them at one
        distance with far positions) and it flattens; the factor keeps its entropy near what the
        model saw in training ("log-n" attention scaling, e.g. Chiang & Cholak 2022, SSMax).
        docs/QUALITY.md, "Length scaling": found a pass key that the cap alone lost."""
        if not self.length_ctx:
            return self.scale
        return self.scale * max(1.0, math.log(self.offset + T) / math.log(self.length_ctx))

    # ---- attention ----------------------------------------------------------------------------
    def attend(self, layer, q, k, v):
        """q [T, Hq, hd], k, v [T, Hkv, hd] at positions offset.. -> [T, Hq, hd]. Stages k, v."""
        T = q.shape[0]
        self._staged[layer] = (k, v)
        qs = q.float() * self._q_scale(T)
        if (T == 1 and self.mode == "hca" and self._numpy_exact_tier and self.offset >= self.S + self.W
                and not self.max_select):   # (the one-call steps select by tau alone)
            if self.n_encoded == self.n_store > 0:
                return self._attend_decode_step(layer, qs, k, v).to(q.dtype)
            if self.layout.exact_keys and self.n_store > 0:
                return self._attend_exact_keys_step(layer, qs, k, v).to(q.dtype)
        qf = self.far.queries(qs, self.offset) if self.far else qs   # what reads sinks and store
        o1, m1, l1 = self._attend_exact_tier(layer, qs, k, v, qf)
        if self.n_store == 0:
            return o1.to(q.dtype)
        if self.mode == "exact":
            o2, m2, l2 = self._attend_store_exact(layer, qf)
        elif self.mode == "anchor":
            na = min(self.anchor_k.shape[2], self.n_store)   # the anchor block's tokens now in the store
            o2, m2, l2 = partial_attention(qf, self.anchor_k[layer, :, :na], self.values.view(layer, na))
        else:
            o2, m2, l2 = self._attend_store_hca(layer, qf)
        o, _, _ = merge((o1, m1, l1), (o2, m2, l2))
        return o.to(q.dtype)

    def _factors(self) -> tuple[np.ndarray, np.ndarray]:
        """Nibble pairs: the 16-centroid factor codebooks transposed, [L, Hkv, G, ds, 16] f32, and
        their norms [L, Hkv, G, 16] (made once per codebook set, with the fast-scan step's scratch
        and the codes it encodes ahead)."""
        if self._fs is None or self._fs[0] is not self.codebooks:
            F = np.ascontiguousarray(self.codebooks.factors.numpy().transpose(0, 1, 2, 4, 3))
            self._fs = (self.codebooks, F, fs.factor_norms(F))
            self._fs_lut = fs.FastScanLUT(self.Hq, F.shape[2], self._lanes) if self._fast_scan else None
            self._hist = kc.level_hist(self.Hq) if self._hist is None else self._hist
            self._new_pending()
        return self._fs[1], self._fs[2]

    def _ring_full(self) -> bool:
        """The ring holds W tokens (every position from S + n_store up to offset): the next token
        in pushes the oldest out to the store. Short after a truncate, until it refills."""
        return self.offset == self.S + self.W + self.n_store

    def _exact_valid(self) -> np.ndarray | None:
        """The one-call steps read every sinks + ring slot. After a truncate (a prompt sharing a
        prefix with the cache) the ring holds fewer than W tokens until it refills, and the dropped
        tokens' slots keep stale K/V: then a uint8 mask of the live slots (made once per step:
        advance, truncate and reset clear it), else None (all live)."""
        if self._ring_full():
            return None
        if self._live_slots is None:
            self._live_slots = (self.slot_pos >= 0).numpy().astype(np.uint8)
        return self._live_slots

    def _codebook_copy_bytes(self) -> int:
        """The CPU kernels' copies of the current codebooks: the transposed layout of the LUT kernel,
        the centroid norms of the encoder, the nibble pairs' transposed factors and their norms (made
        on first use)."""
        own = [c for c in (self._cbt, self._cnorm, self._fs) if c is not None and c[0] is self.codebooks]
        return sum(a.nbytes for c in own for a in c[1:])      # (codebooks, arrays made from them...)

    def _decode_scratch(self) -> list:
        """Fixed-size scratch of the CPU decode kernels, where made: the lookup table, its packed
        form, the level-bucket counts and the ring-key codes encoded ahead."""
        arrs = [a for a in (self._lut, self._hist, self._pending) if a is not None]
        if self._packed is not None:
            p = self._packed
            arrs += [p.tables, p.scale, p.offset, p.top, p.shift]   # (lanes is self._lanes, not scratch)
        if self._fs_lut is not None:
            arrs += self._fs_lut.arrays
        return arrs

    def _levels(self, n: int) -> np.ndarray:
        """The level scratch [Hq, n] uint16 of the CPU selection (kernels_cpu.level_select)."""
        return self.lev.flat(n).view(np.uint16).reshape(self.Hq, n)

    def _attend_exact_tier(self, layer, qs, k, v, qf):
        """Sinks + ring (all positions < offset) and the chunk itself (causal). Far positions: the
        sinks (held unrotated) in a partial of their own with the far queries qf."""
        T = qs.shape[0]
        valid = self.slot_pos >= 0                                               # [S+W]
        sinks = valid[:self.S].clone()
        if self.far:
            valid[:self.S] = False
        K = torch.cat([self.ek[layer], k.transpose(0, 1).to(self.ek.dtype)], 1)  # [Hkv, S+W+T, hd]
        V = torch.cat([self.ev[layer], v.transpose(0, 1).to(self.ek.dtype)], 1)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask = torch.cat([valid[None, :].expand(T, -1), causal], 1).to(qs.device)
        part = partial_attention(qs, K, V, mask)
        if self.far and bool(sinks.any()):
            smask = sinks[None, :].expand(T, -1).to(qs.device)
            part = merge(part, partial_attention(qf, self.ek[layer, :, :self.S],
                                                 self.ev[layer, :, :self.S], smask))
        return part

    def _attend_store_exact(self, layer, qs):
        """Exact attention over the store (exact prefill: full-precision keys kept for all of it)."""
        n = self.n_store
        K = self.exact_keys.view(layer, n)                                        # [Hkv, n, hd]
        return partial_attention(qs, K, self.values.view(layer, n))

    def _attend_store_hca(self, layer, qs):
        """Per query: approximate scores, threshold selection, weighted sum of host values."""
        T, n, ne = qs.shape[0], self.n_store, self.n_encoded
        qn = qs.numpy() if qs.device.type == "cpu" else qs.cpu().numpy()
        z = self.z.flat(n).reshape(self.Hq, n)
        sel = self.sel.flat(n).reshape(self.Hq, n)
        V = self.values.view(layer, self.values.cap_or(n)).numpy()
        P = self.indices.view(layer, self.indices.cap_or(n)).numpy() if ne else None
        Kx = self.exact_keys.view(layer, n - self.exact_base) if n > ne else None   # positions [ne, n)
        Kh = self.host_keys.view(layer, self.host_keys.cap_or(n)).numpy() if self.host_keys is not None else None
        os_, ms, ls = np.empty((T, self.Hq, self.hd), np.float32), np.empty((T, self.Hq), np.float32), np.empty((T, self.Hq), np.float32)
        if ne and self._fast_scan:   # nibble pairs: levels from the fast-scan tables, as float scores
            F = self._factors()[0][layer]
            for t in range(T):
                lut = fs.fs_lut(qn[t], F, self.q_to_kv, out=self._fs_lut)
                lev, _, _ = fs.fs_levels(lut, P, ne, self.q_to_kv, scratch=(self._levels(ne), self._hist))
                np.multiply(lev, lut.scale[:, None], out=z[:, :ne])
                z[:, :ne] += lut.offset[:, None]
                os_[t], ms[t], ls[t] = self._store_from_scores(qn[t], z, sel, V, Kx, Kh, n, ne, T)
            return torch.from_numpy(os_), torch.from_numpy(ms), torch.from_numpy(ls)
        C = self.codebooks.centroids[layer].numpy() if ne else None
        Ct = self._codebooks_t()[layer] if ne else None
        for t in range(T):
            if ne:
                lut = kc.build_lut(qn[t], C, self.q_to_kv, codebooks_t=Ct, out=self._lut)
                packed = kc.pack_lut(lut, self.q_to_kv, out=self._packed)
            if ne == n:   # the decode step's scores and selection (kernels_cpu.level_select)
                idx, counts, _, _, zs = kc.packed_select(packed, P, n, self.tau, out_idx=sel, out_z=z,
                                                         scratch=(self._levels(n), self._hist))
                if self.max_select:
                    cap_selection(idx, counts, zs, self.max_select, compact=True)
                if self.record_selection is not None and T == 1:
                    self.record_selection.append(counts / n)
                if Kh is not None:
                    kc.selected_scores(qn[t], Kh, idx, counts, self.q_to_kv, zs, compact=True)
                os_[t], ms[t], ls[t] = kc.weighted_value_sum(zs, idx, counts, V, self.q_to_kv, compact=True)
                continue
            if ne:
                kc.packed_scores(packed, P, ne, out=z)
            os_[t], ms[t], ls[t] = self._store_from_scores(qn[t], z, sel, V, Kx, Kh, n, ne, T)
        return torch.from_numpy(os_), torch.from_numpy(ms), torch.from_numpy(ls)

    def _store_from_scores(self, q, z, sel, V, Kx, Kh, n, ne, T):
        """One query's store partial (o, m, l) from approximate scores z[:, :ne] (and exact ones
        for the keys not yet encoded, Kx): threshold selection and the weighted value sum, the
        selected tokens rescored from the host keys Kh first where there are any."""
        if n > ne:   # keys not yet encoded: exact scores
            qt = torch.from_numpy(q).view(self.Hkv, -1, self.hd)
            z[:, ne:] = torch.bmm(qt, Kx.transpose(1, 2)).reshape(self.Hq, -1).numpy()
        idx, counts, _, _ = kc.threshold_select(z, self.tau, out_idx=sel)
        if self.max_select:
            cap_selection(idx, counts, z, self.max_select, compact=False)
        if self.record_selection is not None and T == 1:
            self.record_selection.append(counts / n)
        if Kh is not None:
            kc.selected_scores(q, Kh, idx, counts, self.q_to_kv, z)
        return kc.weighted_value_sum(z, idx, counts, V, self.q_to_kv)

    # ---- moving tokens between tiers ----------------------------------------------------------------
    def advance(self, n: int) -> None:
        """Commit the staged chunk of n tokens: fill sinks, then the ring; evict the ring's overflow.

        Works on all layers at once (one gather, one encode, one copy per step), since every layer
        moves the same positions.
        """
        if n == 1 and self.W > 0 and self.offset >= self.S:         # decode: one token into the ring
            self._advance_one(self.offset)
        else:
            self._advance_chunk(n)

    def _advance_chunk(self, n: int) -> None:
        """advance(n), the general path: index arithmetic over the chunk's and the ring's positions."""
        pos0, end, S, W = self.offset, self.offset + n, self.S, self.W
        self._live_slots = None
        ev_lo, ev_hi = S + self.n_store, max(S, end - W)          # positions leaving for the store
        ev_pos = torch.arange(ev_lo, max(ev_lo, ev_hi))
        keep = torch.arange(pos0, end)                              # chunk positions that stay exact
        keep = keep[(keep < S) | (keep >= ev_hi)]
        Kn = torch.stack([kv[0] for kv in self._staged]).transpose(1, 2).to(self.ek.dtype)   # [L, Hkv, T, hd]
        Vn = torch.stack([kv[1] for kv in self._staged]).transpose(1, 2).to(self.ek.dtype)
        if ev_pos.numel():
            from_ring = ev_pos[ev_pos < pos0]
            ring_slots = self._ring_slot(from_ring)
            from_chunk = ev_pos[ev_pos >= pos0] - pos0
            Ke = torch.cat([self.ek[:, :, ring_slots], Kn[:, :, from_chunk]], 2)            # [L, Hkv, m, hd]
            Ve = torch.cat([self.ev[:, :, ring_slots], Vn[:, :, from_chunk]], 2)
            self._store_append(Ke, Ve, self._take_pending(int(ev_pos[0]) if ev_pos.numel() == 1 else -1))
            self.slot_pos[ring_slots] = -1
        if keep.numel():
            slots = torch.where(keep < S, keep, self._ring_slot(keep))
            Kk = Kn[:, :, keep - pos0]
            if self.far and bool((keep < S).any()):   # sinks are held unrotated (read at distance D)
                Kk = torch.where((keep < S)[:, None].to(Kk.device), self.far.unrotate(Kk, keep), Kk)
            self.ek[:, :, slots] = Kk
            self.ev[:, :, slots] = Vn[:, :, keep - pos0]
            self.slot_pos[slots] = keep
        self._staged = [None] * self.n_layers
        self.offset = end
        self._fit_when_due()

    def _advance_one(self, pos: int) -> None:
        """advance(1) of a token at pos >= S (every decode step): with a full ring, the ring's
        oldest token leaves for the store and the new one takes its slot; with a ring not yet full
        (a short context, or after a truncate: every bench round) the new one takes a dead slot.
        The general path's index arithmetic and gathers cost ~1.5 ms per step in torch calls on the
        2-core VM; this is a few slice copies."""
        slot = self._ring_slot(pos)                               # = the leaving token's slot, if any
        if self._ring_full():
            codes = self._take_pending(pos - self.W)
            self._store_append(self.ek[:, :, slot:slot + 1], self.ev[:, :, slot:slot + 1], codes)   # (copies)
            self._live_slots = None
        elif self._live_slots is not None:
            self._live_slots[slot] = 1                            # the mask stays valid: one more live slot
        self.ek[:, :, slot] = torch.stack([kv[0][0] for kv in self._staged])         # [L, Hkv, hd]
        self.ev[:, :, slot] = torch.stack([kv[1][0] for kv in self._staged])
        self._ring_took(pos, slot)

    def _ring_slot(self, pos):
        """The ring slot of the token at pos >= S (an int, or an int64 tensor of positions; the
        slot the token W positions before it held)."""
        return self.S + (pos - self.S) % self.W

    def _ring_took(self, pos: int, slot: int) -> None:
        """The host's bookkeeping once the token at pos is in its ring slot: one step done."""
        self.slot_pos[slot] = pos
        self._staged = [None] * self.n_layers
        self.offset = pos + 1
        self._fit_when_due()

    def _take_pending(self, pos: int) -> torch.Tensor | None:
        """The codes [L, Hkv, 1, g] the decode steps encoded ahead, if they are position pos's (the
        one token leaving the ring) for every layer; None otherwise. Either way they are used up."""
        codes = None
        if pos == self._pending_pos >= 0 and self._pending_done.all():
            codes = torch.from_numpy(self._pending)
        self._pending_pos = -1
        return codes

    def _fit_when_due(self) -> None:
        """Without codebooks, fit them from the prompt's keys once fit_min_tokens have left the ring."""
        if self.codebooks is None and self.mode != "exact" and not self.layout.exact_keys \
                and self.n_store >= self.fit_min_tokens:
            self._fit_and_encode()

    def _keeps_exact_keys(self) -> bool:
        return self.layout.exact_keys or self.codebooks is None or self.mode == "exact"

    def _codebooks_t(self) -> np.ndarray:
        """Codebooks laid out [L, Hkv, g, ds, c] for the fast LUT kernel (made once per codebook set)."""
        if self._cbt is None or self._cbt[0] is not self.codebooks:
            C = self.codebooks.centroids.numpy()
            self._cbt = (self.codebooks, np.ascontiguousarray(C.transpose(0, 1, 2, 4, 3)))
            g, c = self.layout.groups, self.layout.centroids
            self._lut = np.empty((self.Hq, g, c), np.float32)
            self._packed = kc.PackedLUT(np.empty((self._lanes.shape[0], g, c), np.uint64), self._lanes,
                                        np.empty(self.Hq, np.float32), np.empty(self.Hq, np.float32))
            self._hist = kc.level_hist(self.Hq)                    # per-thread level-bucket counts
        return self._cbt[1]

    def _codebook_norms(self) -> np.ndarray:
        """||c||^2 per centroid, [L, Hkv, g, c] f32 (made once per codebook set); also makes the
        decode steps' scratch for the codes they encode."""
        if self._cnorm is None or self._cnorm[0] is not self.codebooks:
            C = self.codebooks.centroids.numpy()
            self._cnorm = (self.codebooks, kc.codebook_norms(C.reshape(-1, *C.shape[2:])).reshape(C.shape[:-1]))
            self._new_pending()
        return self._cnorm[1]

    def _new_pending(self) -> None:
        """The scratch of the codes the decode steps encode ahead, [L, Hkv, 1, g] of the index dtype
        (made with each codebook set's encoder state), none pending yet."""
        self._pending = np.empty((self.n_layers, self.Hkv, 1, self.layout.groups),
                                 np.uint8 if self.layout.index_bytes == 1 else np.int16)
        self._pending_pos = -1

    def _encode(self, K: torch.Tensor) -> torch.Tensor:
        """K [L, Hkv, m, hd] -> indices [L, Hkv, m, g], one kernel call for all layers."""
        L, Hkv, m, hd = K.shape
        if self.layout.pairs:   # nibble pairs, from the 16-centroid factors (the product's nearest)
            F, fnorm = self._factors()
            P = fs.encode_pairs(K.float().reshape(L * Hkv, m, hd).numpy(), F.reshape(L * Hkv, *F.shape[2:]),
                                fnorm.reshape(L * Hkv, *fnorm.shape[2:]))
            return torch.from_numpy(P).view(L, Hkv, m, -1)
        C = self.codebooks.centroids.reshape(L * Hkv, *self.codebooks.centroids.shape[2:]).numpy()
        cn = self._codebook_norms().reshape(L * Hkv, *self._cnorm[1].shape[2:])
        Ct = self._codebooks_t().reshape(L * Hkv, *self._cbt[1].shape[2:])   # encode_keys picks its path by m
        P = kc.encode_keys(K.float().reshape(L * Hkv, m, hd).numpy(), C, cnorm=cn, codebooks_t=Ct)
        return torch.from_numpy(P).view(L, Hkv, m, -1)

    def _store_append(self, K, V, codes=None):
        """K, V [L, Hkv, m, hd] leave the ring: values to the host pool, keys encoded (or kept exact).
        codes: their indices [L, Hkv, m, g] when already encoded (by the decode step)."""
        j0, m = self.n_store, K.shape[2]
        if self.far:   # positions S + j0.. leave the ring: kept unrotated (codes encoded ahead were of rotated keys)
            K, codes = self.far.unrotate(K, torch.arange(self.S + j0, self.S + j0 + m)), None
        self.values.reserve(j0 + m)
        if self.host_keys is not None:
            self.host_keys.reserve(j0 + m)
            self.host_keys.write_all(j0, K)
        self.z.reserve(j0 + m)
        self.sel.reserve(j0 + m)
        if self.lev is not None:
            self.lev.reserve(j0 + m)
        self.values.write_all(j0, V)
        if self.anchor_k is not None and j0 < self.anchor_k.shape[2]:
            cnt = min(m, self.anchor_k.shape[2] - j0)
            self.anchor_k[:, :, j0:j0 + cnt] = K[:, :, :cnt].float()
        if self._keeps_exact_keys():
            self.exact_keys.reserve(j0 + m - self.exact_base)
            self.exact_keys.write_all(j0 - self.exact_base, K.float())
        else:
            self.indices.reserve(j0 + m)
            self.indices.write_all(j0, self._encode(K) if codes is None else codes)
            self.n_encoded = j0 + m
        self.n_store = j0 + m

    def _fit_and_encode(self):
        """Fit codebooks on the full-precision store keys (if none), encode them all, drop them."""
        n = self.n_store
        keys = self.exact_keys.data[:, :, :n - self.exact_base]                   # [L, Hkv, m, hd]
        if self.codebooks is None:
            cb = Codebooks.fit(keys, *self.layout.codebook_geometry[:2], iters=20)
            self.codebooks = cb.paired() if self.layout.pairs else cb
            self.notes.append(f"codebooks fitted from {n - self.exact_base} prompt keys")
        self.indices.reserve(n)
        self.indices.write_all(self.exact_base, self._encode(keys))
        self.n_encoded = n
        self.exact_keys.free()
        self.exact_base = n

    def begin_prefill(self, mode: str) -> None:
        """The coming chunks attend to the store exactly ("exact": full-precision keys kept until
        end_prefill), to an exact anchor block only ("anchor", paper App. B: linear cost), or through
        the HCA path ("hca"). exact and anchor need the store's keys from the start: an empty cache."""
        self.mode = mode if (mode in ("exact", "anchor") and self.n_store == 0) else "hca"
        if self.mode == "anchor":
            L, Hkv, _, hd = self.ek.shape
            self.anchor_k = torch.zeros(L, Hkv, max(0, self.anchor_tokens - self.S), hd, device=self.ek.device)

    def end_prefill(self) -> None:
        """Encode the prompt's store keys (fitting codebooks on them when there are none)."""
        self.mode = "hca"
        self.anchor_k = None
        if not self.layout.exact_keys and self.n_store > self.n_encoded:
            self._fit_and_encode()

    # ---- bookkeeping ----------------------------------------------------------------------------
    def checkpoint(self, name: str = "prompt") -> None:
        """Keep a copy of the sinks + ring under `name` (kv/ring_checkpoint.py): a later truncate
        back to any position the ring holds now works after these tokens left it."""
        self.rewind_points[name].take(self)

    def truncate(self, n: int) -> bool:
        """Possible while the dropped tokens are all in the ring (or the sinks of a short context),
        or back into the ring of the last checkpoint."""
        if n == self.offset:
            return True
        if n > self.offset:
            return False
        if self.n_store and n < self.S + self.n_store:
            copy = next((c for c in self.rewind_points.values() if c.can_restore(self, n)), None)
            if copy is None:
                return False
            copy.restore(self)
        for c in self.rewind_points.values():
            c.truncated(n)
        drop = (self.slot_pos >= n)
        self.slot_pos[drop] = -1
        self._live_slots = None
        self.offset = n
        self._pending_pos = -1
        return True

    def reset(self) -> None:
        self.offset = self.n_store = self.n_encoded = self.exact_base = 0
        self._pending_pos = -1
        self._live_slots = None
        self.slot_pos.fill_(-1)
        self.exact_keys.free()
        self.mode = "hca"
        for c in self.rewind_points.values():
            c.drop()

    def stats(self) -> dict:
        exact_tier = 2 * self.ek.numel() * self.ek.element_size()
        keys = self.indices.nbytes if self.indices is not None else 0
        s = {
            "tokens": self.offset,
            "tokens_exact": int((self.slot_pos >= 0).sum()),
            "tokens_store": self.n_store,
            "device_keys_bytes": keys + (self.exact_keys.nbytes if self.layout.exact_keys else 0),
            "device_ring_sinks_bytes": exact_tier,
            "codebook_bytes": (self.codebooks.nbytes if self.codebooks is not None else 0) + self._codebook_copy_bytes(),
            "host_values_bytes": self.values.nbytes,
            "host_keys_bytes": self.host_keys.nbytes if self.host_keys is not None else 0,
            "scratch_bytes": self.z.nbytes + self.sel.nbytes + (self.lev.nbytes if self.lev is not None else 0),
            "prefill_keys_bytes": 0 if self.layout.exact_keys else self.exact_keys.nbytes,
            "decode_scratch_bytes": sum(a.nbytes for a in self._decode_scratch()),
            "ring_copy_bytes": sum(c.nbytes for c in self.rewind_points.values()),
        }
        s["total_bytes"] = sum(v for k, v in s.items() if k.endswith("_bytes"))
        return s
