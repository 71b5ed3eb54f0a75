"""The HCAttention cache's tiers and their bookkeeping, shared by its two backends.

Tiers and invariants (tests/kv/test_hca_cache.py):
- every position in [0, offset) lives in exactly one tier: sinks [0, S), store [S, S + n_store),
  ring [S + n_store, offset) with at most W tokens; keys are stored post-RoPE, so each keeps its
  position, unless the position scheme places sinks and store keys otherwise (`positions`:
  kv/positions.py; far positions hold them unrotated, kv/far_positions.py);
- the ring slot of position p >= S is S + (p - S) % W; `slot_pos` records which position each holds
  (kv/ring.py);
- `attend` never mutates: it stages the chunk's k, v; `advance` moves tokens between tiers, all
  layers at once; the store only appends (its keys encoded by the key store, its values in the
  host pool), `truncate` only drops ring tokens (after putting back a copied ring, where it goes
  back past the ring: `checkpoint`, kv/ring_checkpoint.py).
Each query head selects its own set of store tokens (the smallest holding tau of its softmax mass
over the key store's scores, then at most max_select of them); values are shared within a kv-head
group. The exact part (sinks + ring + the chunk) and the store's part merge by log-sum-exp.

A backend (hca.py: the CPU, Numba; hca_cuda.py: a GPU, CUDA kernels) passes where its buffers
live (kv/hca_buffers.py: the tiers hca_layout.hca_tiers declares are made through it), encodes keys
and attends in hca mode (HCABase's "what a backend provides"). Prefill modes: "exact" (the store's
keys kept in full precision until end_prefill: exact attention), "anchor" (every chunk attends
exactly to the first anchor_tokens, paper App. B: linear cost), "hca" (the store through the
selection). What a prompt-cache file holds of the cache: kv/hca_state.py.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import torch

from .attention import exact_tier_partial, merge, partial_attention
from .base import KVCache
from .codebooks import Codebooks, codebook_filename
from .head_budgets import head_caps_for
from .far_positions import far_positions_on, position_scheme
from .hca_layout import hca_tiers, prefill_buffers, resolve_layout
from .hca_state import SavedState
from .rescore import HostKeyRescore, NoRescore
from .ring import Ring
from .ring_checkpoint import RewindPoints
from .value_codes import value_codes


def notices(trained: int, length_ctx, positions, missing_codebooks):
    """What a user is told when the cache is made: length scaling where it is on, the position
    scheme's lines, and codebooks that will be fitted from the prompt (missing_codebooks: the
    file's name)."""
    if length_ctx:
        yield f"length scaling: attention logits x log(n) / log({trained}) past {trained} tokens"
    yield from positions.notices()
    if missing_codebooks:
        yield (f"no {missing_codebooks} in the model directory: codebooks will be fitted from the prompt's own keys "
               f"(run `minirun calibrate{' --unrotated' if positions.unrotated else ''}` to make one)")


class HCABase(SavedState, KVCache):
    """See the module docstring; HCACache (CPU) and HCACacheCUDA (GPU) are its backends."""

    def __init__(self, args, config, device: torch.device, dtype: torch.dtype, capacity: int, buffers,
                 model_dir=None):
        """The cache of config's HCA settings, holding at most `capacity` tokens, its tiers made by
        `buffers` (kv/hca_buffers.py: the backend's); its codebooks from model_dir's calibrated file
        where there is one, else fitted from the prompt's own keys."""
        super().__init__(args.num_hidden_layers, capacity)
        L, Hkv, hd = args.num_hidden_layers, args.num_key_value_heads, args.head_dim
        layout, trained = resolve_layout(args, config), args.max_position_embeddings
        self.Hq, self.Hkv, self.hd = args.num_attention_heads, Hkv, hd
        self.layout, self.tau, self.dtype, self.device = layout, config.tau, dtype, device
        # top tokens per head and step at most (whole score bins from the top); None: tau alone
        self.max_select = config.max_select
        self.S, self.W = sinks, window = config.sinks, config.window
        self.scale = 1.0 / math.sqrt(hd)
        # length scaling on: the trained context N (see _q_scale); None: off
        self.length_ctx = trained if far_positions_on(config.length_scale, trained, capacity) else None
        # where old tokens sit (kv/positions.py: plain, or far positions), and the far scheme or
        # None as callers outside the cache read it
        self.positions = position_scheme(args, config, capacity)
        self.far = self.positions if self.positions.far else None
        self.q_to_kv = np.arange(self.Hq, dtype=np.int32) // (self.Hq // Hkv)
        # every buffer's shape and dtype, as `minirun plan` counts them (kv/hca_layout.hca_tiers)
        self.backend = buffers.backend
        self.value_codes = value_codes(config.kv_values, hd, dtype, device.type)   # how the pool holds a value row
        self.tiers = hca_tiers(args, layout, capacity, sinks, window, dtype, self.backend, config.rescore, device.type,
                               self.value_codes.kind)
        self.prefill_specs = prefill_buffers(args, capacity, sinks, window, config.anchor_tokens, dtype, self.backend)
        # exact tier: sinks then ring slots, and the position held by each slot (-1 = empty)
        self.ek, self.ev = buffers.exact_tier(self.tiers["sinks+ring K+V"].buffers["ek"])
        self.ring = Ring(sinks, window)
        self.slot_pos = self.ring.slot_pos
        # values (host pool), rescore's host keys (the store's keys as the codebooks encoded them,
        # so the selected tokens are weighted by exact scores; an exact-key store has them already),
        # the key store (codebook indices), full-precision keys (permanent with exact_keys, else only
        # while codebooks are missing or an exact prefill runs: positions [exact_base, n_store)),
        # and the scores' scratch (z, sel, and the backend's own)
        pool, keys = self.tiers["value pool"].buffers["values"], self.tiers["key store"].buffers
        host_keys = self.tiers.get("host keys")
        self.values = buffers.pool(pool, read_by_device=True)
        self.host_keys = None if host_keys is None else buffers.pool(host_keys.buffers["host_keys"], False)
        # the rescoring step (kv/rescore.py): exact scores from the host keys, or the key store's
        self.rescoring = NoRescore() if self.host_keys is None else HostKeyRescore(self.host_keys)
        self.indices = None if layout.exact_keys else buffers.indices(keys["indices"])
        self.exact_keys = buffers.grow(keys.get("exact_keys") or self.prefill_specs["exact_keys"])
        # the device copy of the store's values an exact prefill attends to, where prefill_buffers
        # declares one (a GPU's: its pool is on the host), else None
        spec = self.prefill_specs.get("prefill_values")
        self.prefill_values = None if spec is None else buffers.grow(spec)
        self.scratch = [buffers.grow(b) for b in self.tiers["scratch"].buffers.values()]
        self.z, self.sel = self.scratch[:2]
        self.exact_base = 0
        self.n_store = 0          # tokens in the store (all layers)
        self.n_encoded = 0        # store tokens [0, n_encoded) have codebook indices
        # a scheme that stores keys unrotated reads codebooks calibrated on unrotated keys
        geometry = layout.codebook_geometry
        name, self.codebooks = codebook_filename(*geometry[:2], unrotated=self.positions.unrotated), None
        if not layout.exact_keys and model_dir is not None and (model_dir / name).is_file():
            cb = Codebooks.load(model_dir / name, (L, Hkv, *geometry))
            self.codebooks = cb.paired() if layout.pairs else cb
        # per-head selection caps [L, Hq] (head_budgets.py: -1 the head skips the store), or None: max_select alone
        self.head_caps = head_caps_for(config, self.positions.unrotated,
                                       model_dir / name if model_dir is not None else None, (L, self.Hq))
        self.fit_min_tokens = config.fit_min_tokens   # no codebooks: fit once this many keys left the ring
        self.mode = "hca"         # "hca" | "exact" | "anchor": how a prefill chunk attends to the store
        self.anchor_k = None      # [L, Hkv, anchor_tokens - S, hd] float32, during an anchor prefill only
        self.anchor_v = None      # and its values on the device, where prefill_buffers declares them (a GPU's)
        self._staged: list = [None] * L
        self.rewind_points = RewindPoints()   # copies of sinks + ring: truncate back past the ring
        # when a list: each one-token step appends, per layer, the fraction of the store each
        # query head selected (float64 [Hq]); the quality tools read it (evaluate.selection_probe)
        self.record_selection: list | None = None
        missing = None if layout.exact_keys or self.codebooks else name
        for line in notices(trained, self.length_ctx, self.positions, missing):
            print(f"minirun: {line}", file=sys.stderr)

    def set_head_caps(self, caps) -> None:
        """Replace the per-head caps: int [L, Hq] (head_budgets.py), or None (max_select alone)."""
        self.head_caps = None if caps is None else np.asarray(caps, np.int64).reshape(self.n_layers, self.Hq)

    def select_cap(self, layer: int):
        """The selection cap of the layer's steps: per query head int64 [Hq] (head budgets; -1 skips
        the store) or one int for all (max_select; 0 none)."""
        return self.max_select or 0 if self.head_caps is None else self.head_caps[layer]

    # ---- what a backend provides ------------------------------------------------------------------------
    def _encode(self, K: torch.Tensor) -> torch.Tensor:
        """K [L, Hkv, m, hd] -> the key store's indices [L, Hkv, m, g], all layers in one call."""
        return self.key_store.encode(K, self.codebooks)

    def _attend_hca(self, layer, q, k, v):
        """hca mode with a store: the whole attention of q [T, Hq, hd] (k, v [T, Hkv, hd]) where the
        backend has a step for it (CPU: any T; GPU: one token), else None: then the exact tier
        and _attend_store_hca, merged."""
        return None

    def _attend_store_hca(self, layer, qs):
        """The store's partial (o [T, Hq, hd], m, l [T, Hq]) for queries qs in hca mode."""
        raise NotImplementedError

    def _take_pending(self, pos: int):
        """Codes a decode step encoded ahead for the token at pos leaving the ring, or None; either
        way they are used up (pos -1: dropped, as truncate and reset do)."""
        return None

    # ---- the cache ----------------------------------------------------------------------------------
    def _q_scale(self, T: int) -> float:
        """The query scale of a step of T queries: 1/sqrt(hd), and with length scaling on times
        max(1, log n / log N), n = offset + T the tokens the step's last query sees, N the trained
        context. As n grows past N, more and more old tokens share one softmax (all of them at one
        distance with far positions) and it flattens; the factor keeps its entropy near what the
        model saw in training ("log-n" attention scaling, e.g. Chiang & Cholak 2022, SSMax)."""
        if not self.length_ctx:
            return self.scale
        return self.scale * max(1.0, math.log(self.offset + T) / math.log(self.length_ctx))

    def attend(self, layer, q, k, v):
        """q [T, Hq, hd], k, v [T, Hkv, hd] at positions offset.. -> [T, Hq, hd]. Stages k, v."""
        T = q.shape[0]
        self._staged[layer] = (k, v)
        if self.mode == "hca" and self.n_store:
            o = self._attend_hca(layer, q, k, v)
            if o is not None:
                return o
        qs = q.float() * self._q_scale(T)
        qf = self.positions.queries(qs, self.offset)   # what reads sinks and store
        exact = self._attend_exact_tier(layer, qs, k, v, qf)
        n = self.n_store
        if n == 0:
            return exact[0].to(q.dtype)
        if self.mode == "exact":
            store = partial_attention(qf, self.exact_keys.view(layer, n), self._prefill_values(layer, n))
        elif self.mode == "anchor":
            na = min(self.anchor_k.shape[2], n)   # the anchor block's tokens now in the store
            store = partial_attention(qf, self.anchor_k[layer, :, :na], self._prefill_values(layer, na))
        else:
            store = self._attend_store_hca(layer, qf)
        return merge(exact, store)[0].to(q.dtype)

    def _prefill_values(self, layer: int, n: int) -> torch.Tensor:
        """The store's first n values [Hkv, n, hd] on the compute device (exact / anchor prefill): the
        host pool, or where there are device copies the exact prefill's or the anchor block's."""
        if self.prefill_values is None:
            rows = self.values.view(layer, n)
            return self.value_codes.decode(rows) if self.value_codes.quantized else rows
        return self.prefill_values.view(layer, n) if self.mode == "exact" else self.anchor_v[layer, :, :n]

    def _attend_exact_tier(self, layer, qs, k, v, qf):
        """Sinks + ring (all positions < offset) and the chunk itself (causal). Far positions: the
        sinks (held unrotated) in a partial of their own with the far queries qf."""
        T, sinks_apart = qs.shape[0], self.positions.far
        valid = self.slot_pos >= 0                                               # [S+W]
        if T > 1:   # a prompt chunk: fused parts, no [Hq, T, S+W+T] scores
            return exact_tier_partial(qs, qf, self.ek[layer], self.ev[layer], valid, self.S, k, v, sinks_apart)
        sinks = valid[:self.S].clone()
        if sinks_apart:
            valid[:self.S] = False
        K = torch.cat([self.ek[layer], k.transpose(0, 1).to(self.ek.dtype)], 1)  # [Hkv, S+W+T, hd]
        V = torch.cat([self.ev[layer], v.transpose(0, 1).to(self.ek.dtype)], 1)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask = torch.cat([valid[None, :].expand(T, -1), causal], 1).to(qs.device)
        part = partial_attention(qs, K, V, mask)
        if sinks_apart and bool(sinks.any()):
            smask = sinks[None, :].expand(T, -1).to(qs.device)
            part = merge(part, partial_attention(qf, self.ek[layer, :, :self.S], self.ev[layer, :, :self.S], smask))
        return part

    # ---- moving tokens between tiers ----------------------------------------------------------------
    def advance(self, n: int) -> None:
        """Commit the staged chunk of n tokens: fill sinks, then the ring; evict the ring's overflow,
        all layers at once (one gather, one encode, one copy per step)."""
        if n == 1 and self.W > 0 and self.offset >= self.S:         # decode: one token into the ring
            self._advance_one(self.offset)
        else:
            self._advance_chunk(n)

    def _advance_chunk(self, n: int) -> None:
        """advance(n), the general path: index arithmetic over the chunk's and the ring's positions."""
        pos0, end, S, W = self.offset, self.offset + n, self.S, self.W
        self.ring.changed()
        ev_lo, ev_hi = S + self.n_store, max(S, end - W)          # positions leaving for the store
        ev_pos = torch.arange(ev_lo, max(ev_lo, ev_hi))
        keep = torch.arange(pos0, end)                              # chunk positions that stay exact
        keep = keep[(keep < S) | (keep >= ev_hi)]
        Kn = torch.stack([kv[0] for kv in self._staged]).transpose(1, 2).to(self.ek.dtype)   # [L, Hkv, T, hd]
        Vn = torch.stack([kv[1] for kv in self._staged]).transpose(1, 2).to(self.ek.dtype)
        if ev_pos.numel():
            from_ring = ev_pos[ev_pos < pos0]
            ring_slots = self.ring.slot(from_ring)
            from_chunk = ev_pos[ev_pos >= pos0] - pos0
            Ke = torch.cat([self.ek[:, :, ring_slots], Kn[:, :, from_chunk]], 2)            # [L, Hkv, m, hd]
            Ve = torch.cat([self.ev[:, :, ring_slots], Vn[:, :, from_chunk]], 2)
            self._store_append(Ke, Ve, self._take_pending(int(ev_pos[0]) if ev_pos.numel() == 1 else -1))
            self.slot_pos[ring_slots] = -1
        if keep.numel():
            slots = torch.where(keep < S, keep, self.ring.slot(keep))
            self.ek[:, :, slots] = self.positions.sink_keys(Kn[:, :, keep - pos0], keep, S)
            self.ev[:, :, slots] = Vn[:, :, keep - pos0]
            self.slot_pos[slots] = keep
        self._staged = [None] * self.n_layers
        self.offset = end
        self._fit_when_due()

    def _advance_one(self, pos: int) -> None:
        """advance(1) of a token at pos >= S (every decode step): with a full ring, the ring's
        oldest token leaves for the store and the new one takes its slot; with a ring not yet full
        (a short context, or after a truncate) the new one takes a dead slot. A few slice copies
        (the general path's index arithmetic costs ~1.5 ms in torch calls on a 2-core CPU)."""
        slot = self.ring.slot(pos)                                # = the leaving token's slot, if any
        evicted = self.ring.full(self.offset, self.n_store)
        if evicted:
            codes = self._take_pending(pos - self.W)
            self._store_append(self.ek[:, :, slot:slot + 1], self.ev[:, :, slot:slot + 1], codes)   # (copies)
        self.ek[:, :, slot] = torch.stack([kv[0][0] for kv in self._staged])         # [L, Hkv, hd]
        self.ev[:, :, slot] = torch.stack([kv[1][0] for kv in self._staged])
        self.ring.entered(pos, slot, evicted)
        self._step_done(pos)

    def _step_done(self, pos: int) -> None:
        """The host's bookkeeping once the token at pos is in its ring slot: one step done."""
        self._staged = [None] * self.n_layers
        self.offset = pos + 1
        self._fit_when_due()

    def _fit_when_due(self) -> None:
        """Without codebooks, fit them from the prompt's keys once fit_min_tokens have left the ring."""
        if self.codebooks is None and self.mode != "exact" and not self.layout.exact_keys \
                and self.n_store >= self.fit_min_tokens:
            self._fit_and_encode()

    def _store_append(self, K, V, codes=None):
        """K, V [L, Hkv, m, hd] leave the ring: values to the host pool, keys encoded (or kept exact).
        codes: their indices [L, Hkv, m, g] when already encoded (by the decode step)."""
        j0, m = self.n_store, K.shape[2]
        K, codes = self.positions.leaving_ring(K, self.S + j0, codes)   # (positions S + j0..)
        self.values.reserve(j0 + m)
        self.rescoring.keys_left_ring(j0, K)
        for buf in self.scratch:
            buf.reserve(j0 + m)
        self.values.write_all(j0, self.value_codes.encode(V))
        if self.mode == "exact" and self.prefill_values is not None:
            self.prefill_values.reserve(j0 + m)
            self.prefill_values.write_all(j0, V)
        if self.anchor_k is not None and j0 < self.anchor_k.shape[2]:
            cnt = min(m, self.anchor_k.shape[2] - j0)
            self.anchor_k[:, :, j0:j0 + cnt] = K[:, :, :cnt].float()
            if self.anchor_v is not None:   # (the same rows: prefill_buffers declares both)
                self.anchor_v[:, :, j0:j0 + cnt] = V[:, :, :cnt]
        if self.layout.exact_keys or self.codebooks is None or self.mode == "exact":
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
        self.indices.reserve(n)
        self.indices.write_all(self.exact_base, self._encode(keys))
        self.n_encoded = n
        self.exact_keys.free()

    def begin_prefill(self, mode: str) -> str:
        """The coming chunks attend to the store exactly ("exact"), to an anchor block ("anchor") or
        through the HCA path ("hca") -> the mode taken: exact and anchor need the store's keys from
        the start, so with a store (older tokens than sinks + ring) it is "hca"."""
        self.mode = mode if (mode in ("exact", "anchor") and self.n_store == 0) else "hca"
        specs = self.prefill_specs
        if self.mode == "anchor":
            self.anchor_k = specs["anchor_k"].zeros(self.ek.device)
            self.anchor_v = specs["anchor_v"].zeros(self.device) if "anchor_v" in specs else None
        return self.mode

    def end_prefill(self) -> None:
        """Encode the prompt's store keys (fitting codebooks on them when there are none)."""
        self.mode = "hca"
        self.anchor_k = self.anchor_v = None
        if not self.layout.exact_keys and self.n_store > self.n_encoded:
            self._fit_and_encode()
        if self.prefill_values is not None:
            self.prefill_values.free()

    # ---- bookkeeping ----------------------------------------------------------------------------
    def checkpoint(self, name: str = "prompt") -> None:
        """Copy sinks + ring under `name` (kv/ring_checkpoint.py): truncate can go back into them."""
        self.rewind_points.copies[name].take(self)

    def truncate(self, n: int) -> bool:
        """Possible while the dropped tokens are all in the ring (or the sinks of a short context),
        or back into the ring of a checkpoint."""
        self._take_pending(-1)      # (the ring may change: codes encoded ahead dropped)
        if n == self.offset:
            return True
        if n > self.offset or (self.n_store and n < self.S + self.n_store
                               and not self.rewind_points.restore(self, n)):
            return False
        self.rewind_points.truncated(n)
        self.ring.drop_from(n)
        self.offset = n
        return True

    def reset(self) -> None:
        self._take_pending(-1)
        self.offset = self.n_store = self.n_encoded = self.exact_base = 0
        self.ring.clear()
        self.exact_keys.free()
        if self.prefill_values is not None:
            self.prefill_values.free()
        self.anchor_k = self.anchor_v = None      # (a reset inside an anchor prefill)
        self.mode = "hca"
        self.rewind_points.drop()

    def stats(self) -> dict:
        exact_tier = 2 * self.ek.numel() * self.ek.element_size()
        keys = self.indices.nbytes if self.indices is not None else 0
        s = {
            "tokens": self.offset,
            "tokens_exact": int((self.slot_pos >= 0).sum()),
            "tokens_store": self.n_store,
            "device_keys_bytes": keys + (self.exact_keys.nbytes if self.layout.exact_keys else 0),
            "device_ring_sinks_bytes": exact_tier,
            "codebook_bytes": self.codebooks.nbytes if self.codebooks is not None else 0,
            "host_values_bytes": self.values.nbytes,
            "host_keys_bytes": self.host_keys.nbytes if self.host_keys is not None else 0,
            "scratch_bytes": sum(b.nbytes for b in self.scratch),
            "prefill_keys_bytes": 0 if self.layout.exact_keys else self.exact_keys.nbytes,
            "ring_copy_bytes": self.rewind_points.nbytes,
        }
        s["total_bytes"] = sum(v for k, v in s.items() if k.endswith("_bytes"))
        return s
