"""HCA geometry (groups, centroids, index type) from the engine config, and the one declaration of
the cache's tiers (hca_tiers, prefill_buffers): the shapes and dtypes the caches allocate, and
the bytes `minirun plan` counts."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import EngineConfig, ModelArgs
from ..errors import MiniRunError
from .value_codes import value_codes

DEFAULT_CENTROIDS = 1024
ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}
# full-precision store keys (the 50% preset's key store, and every prompt's keys during an exact
# prefill) are float32 whatever the compute dtype, in both caches (HCACache.exact_keys)
EXACT_KEY_DTYPE = torch.float32


@dataclass(frozen=True)
class HCALayout:
    exact_keys: bool      # True: keys kept in full precision (the 50% preset / key_store="exact")
    groups: int           # g: sub-vectors per key (pairs: the pair groups, g / 2 of the codebooks')
    centroids: int        # c: centroids per group (pairs: 256, the product's)
    head_dim: int
    # 16-centroid codebooks with an even g: two 4-bit codes per byte, the index of their pair's
    # product codebook (Codebooks.paired); scored by kernels_cpu.fastscan on the CPU
    pairs: bool = False

    @property
    def sub_dim(self) -> int:
        return self.head_dim // self.groups

    @property
    def index_bytes(self) -> int:
        return 1 if self.centroids <= 256 else 2

    @property
    def codebook_geometry(self) -> tuple[int, int, int]:
        """(groups, centroids, sub_dim) of the codebooks that are fitted, calibrated and saved."""
        if self.pairs:
            return 2 * self.groups, 16, self.sub_dim // 2
        return self.groups, self.centroids, self.sub_dim


def resolve_layout(args: ModelArgs, cfg: EngineConfig) -> HCALayout:
    """Table 1 presets: 0.5 = exact keys; 0.25 = g = d/2; 0.125 = g = d/4 (int16 indices, c = 1024).
    Explicit groups= / centroids= override them; c = 16 with an even g stores nibble pairs
    (groups=head_dim, centroids=16: 4 bits per dimension, as many key bytes as the 0.125 preset)."""
    hd = args.head_dim
    budget = cfg.kv_budget if cfg.kv_budget is not None else 0.25
    exact = cfg.key_store == "exact" or (budget >= 0.5 and cfg.groups is None)
    if budget not in (0.5, 0.25, 0.125) and cfg.groups is None:
        raise MiniRunError(f"kv_budget must be 0.5, 0.25 or 0.125 (or give groups=), got {budget}")
    g = cfg.groups or {0.5: hd // 2, 0.25: hd // 2, 0.125: hd // 4}[budget]
    c = cfg.centroids or DEFAULT_CENTROIDS
    if hd % g:
        raise MiniRunError(f"groups={g} does not divide head_dim={hd}")
    if not 2 <= c <= 32768:
        raise MiniRunError(f"centroids must be in [2, 32768], got {c}")
    if not exact and c == 16 and g % 2 == 0:
        return HCALayout(exact, g // 2, 256, hd, pairs=True)
    return HCALayout(exact, g, c, hd)


def on_cpu(cfg: EngineConfig) -> bool:
    """Whether the engine of this config runs on the CPU ("auto" without a CUDA device)."""
    return cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())


@dataclass(frozen=True)
class Buffer:
    """One tensor of the cache: [*lead, rows, width] of dtype (width 1: scratch rows [*lead, rows]),
    at most `rows` tokens (the store's buffers grow up to it: kv/store.py, kv/pinned.py)."""
    lead: tuple
    rows: int
    width: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.lead) * self.rows * self.width * self.dtype.itemsize

    def zeros(self, device) -> torch.Tensor:
        """The whole buffer at once, zeroed (the tensors that do not grow)."""
        return torch.zeros(*self.lead, self.rows, self.width, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class Tier:
    """A planner row: where its buffers live, and the buffers the cache allocates from it; `sized`
    is the bytes of what the kernels allocate themselves (the CPU decode step's tables, the
    codebooks' kernel copies), declared by size."""
    where: str                      # "device" | "host" (host: page-locked with a GPU)
    buffers: dict                   # name -> Buffer
    sized: int = 0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values()) + self.sized


def values_dtype(dtype: torch.dtype) -> torch.dtype:
    """The host value pool of float values (kv_values "float") and rescore's host keys: float32 for
    float32 runs, float16 otherwise."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def exact_tier_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The sinks + ring dtype: the compute dtype, except bfloat16 on the CPU, held as float16 (the
    same bytes) because the Numba decode step reads float32 or float16 only; float16 holds every
    bfloat16 value exactly between 6e-5 and 65504 (keys and values live well inside), like the
    host value pool of bfloat16 runs."""
    return torch.float16 if device_type == "cpu" and dtype == torch.bfloat16 else dtype


def hca_tiers(args: ModelArgs, lay: HCALayout, capacity: int, sinks: int, window: int, dtype: torch.dtype,
              backend: str, rescore: bool = False, device_type: str | None = None, kv_values: str = "auto") -> dict:
    """name -> Tier of an HCA cache holding `capacity` tokens with `backend`'s kernels ("cpu": Numba,
    "cuda") on a device of device_type (default: the backend's): what the caches allocate (HCABase
    and its backends take their buffers' shapes and dtypes from here) and what `minirun plan`
    counts (hca_tier_bytes). kv_values: the value pool's rows (kv/value_codes.py). Buffers of
    prefill only: prefill_buffers."""
    L, Hkv, Hq, hd = args.num_hidden_layers, args.num_key_value_heads, args.num_attention_heads, args.head_dim
    cpu, SW = backend == "cpu", sinks + window
    n = max(0, capacity - SW)
    et = exact_tier_dtype(dtype, device_type or backend)
    codes = value_codes(kv_values, hd, dtype, device_type or backend)
    index = torch.uint8 if lay.index_bytes == 1 else torch.int16
    # (on a GPU the exact tier has one spare row per layer and kv-head: the decode step's own token)
    ring = Buffer((L, Hkv), SW + (0 if cpu else 1), hd, et)
    # two copies of sinks + ring (kv/ring_checkpoint.py: prefix reuse past the ring)
    copy = Buffer((L, Hkv), SW, hd, et)
    tiers = {
        "sinks+ring K+V": Tier("device", {"ek": ring, "ev": ring}),
        "sinks+ring copies": Tier("device", {f"{c}.{t}": copy for c in ("prompt", "shared") for t in ("ek", "ev")}),
        "key store": Tier("device", {"exact_keys": Buffer((L, Hkv), n, hd, EXACT_KEY_DTYPE)} if lay.exact_keys else
                          {"indices": Buffer((L, Hkv), n, lay.groups, index)}),
        "value pool": Tier("host", {"values": Buffer((L, Hkv), n, codes.width, codes.dtype)}),
    }
    if rescore and not lay.exact_keys:   # the store's keys beside the values, in the same type
        tiers["host keys"] = Tier("host", {"host_keys": Buffer((L, Hkv), n, hd, values_dtype(dtype))})
    # per-step scratch: approximate scores and selected indices, and on the CPU the integer score
    # levels (kernels_cpu.level_select)
    scratch = {"z": Buffer((Hq,), n, 1, torch.float32), "sel": Buffer((Hq,), n, 1, torch.int32)}
    if cpu:
        scratch["lev"] = Buffer((Hq,), n, 1, torch.int16)
    tiers["scratch"] = Tier("device", scratch)
    if cpu:
        tiers["decode scratch"] = Tier("device", {}, cpu_decode_scratch_bytes(args, lay))
    if not lay.exact_keys:
        tiers["codebooks"] = Tier("device", {}, codebook_bytes(args, lay, cpu))
    return tiers


def prefill_buffers(args: ModelArgs, capacity: int, sinks: int, window: int, anchor_tokens: int, dtype: torch.dtype,
                    backend: str) -> dict:
    """name -> Buffer of what an HCA cache holds only while a prompt is prefilled, at most: the
    store's keys in full precision (an exact prefill, or until codebooks are fitted), the anchor
    block's keys (an anchor prefill) and, with the CUDA kernels, device copies of the values of
    both. The planner counts their peak per prefill mode (planner.prefill_transient_tiers)."""
    L, Hkv, hd = args.num_hidden_layers, args.num_key_value_heads, args.head_dim
    n, anchor = max(0, capacity - sinks - window), max(0, anchor_tokens - sinks)
    bufs = {"exact_keys": Buffer((L, Hkv), n, hd, EXACT_KEY_DTYPE), "anchor_k": Buffer((L, Hkv), anchor, hd, EXACT_KEY_DTYPE)}
    if backend != "cpu":
        bufs["prefill_values"] = Buffer((L, Hkv), n, hd, dtype)
        bufs["anchor_v"] = Buffer((L, Hkv), anchor, hd, dtype)
    return bufs


def codebook_bytes(args: ModelArgs, lay: HCALayout, cpu: bool) -> int:
    """The codebooks (float32; pairs: the product codebooks) and, on the CPU, the kernels' copies:
    the 16-centroid factors, their transposed copy and norms (pairs), or the encoder's centroid
    norms, and the LUT kernel's transposed copy where it scores (not fast scan)."""
    L, Hkv = args.num_hidden_layers, args.num_key_value_heads
    cb = L * Hkv * lay.groups * lay.centroids * lay.sub_dim * 4
    if not cpu:
        return cb
    if lay.pairs:
        G, _, ds = lay.codebook_geometry
        copies = L * Hkv * G * 16 * (2 * ds + 1) * 4
    else:
        copies = L * Hkv * lay.groups * lay.centroids * 4
    if not fast_scan(lay):
        copies += cb
    return cb + copies


def hca_tier_bytes(args: ModelArgs, cfg: EngineConfig, ctx: int) -> dict:
    """name -> (bytes, "device" | "host") for an HCA cache holding `ctx` tokens (hca_tiers')."""
    tiers = hca_tiers(args, resolve_layout(args, cfg), ctx, cfg.sinks, cfg.window, getattr(torch, cfg.dtype),
                      "cpu" if on_cpu(cfg) else "cuda", cfg.rescore, kv_values=cfg.kv_values)
    return {name: (t.nbytes, t.where) for name, t in tiers.items()}


def fast_scan(lay: HCALayout) -> bool:
    """Whether the CPU cache scores this layout with kernels_cpu.fastscan (nibble pairs on AVX2)."""
    if not lay.pairs:
        return False
    from kernels_cpu.fastscan import available
    return available()


def cpu_decode_scratch_bytes(args: ModelArgs, lay: HCALayout) -> int:
    """Fixed scratch of the CPU decode step (the key stores' `scratch`, kv/key_store_cpu.py): the
    level-bucket counts int32 [Numba threads, Hq, 4096] (exact keys: only these); the lookup table
    f32 [Hq, g, c] and its packed uint64 tables [R, g, c] (R = Hkv x ceil(query heads per kv-head
    / 4)), or with fast scan the tables f32 and uint8 [Hq, G, 16]; per head scale, offset (f32),
    top, shift (int64); the ring-key codes encoded ahead [L, Hkv, 1, g] (not by nibble pairs
    without fast scan)."""
    import numba
    from kernels_cpu.level_select import NB
    L, Hkv, Hq = args.num_hidden_layers, args.num_key_value_heads, args.num_attention_heads
    hist = numba.config.NUMBA_NUM_THREADS * Hq * NB * 4
    if lay.exact_keys:
        return hist
    g, c, ahead = lay.groups, lay.centroids, L * Hkv * lay.groups * lay.index_bytes
    if fast_scan(lay):
        return hist + Hq * lay.codebook_geometry[0] * 16 * 5 + Hq * 24 + ahead
    R = Hkv * math.ceil(Hq // Hkv / 4)
    return hist + Hq * g * c * 4 + R * g * c * 8 + Hq * 24 + (0 if lay.pairs else ahead)
