"""HCA geometry (groups, centroids, index type) from the engine config, and its bytes per tier."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfig, ModelArgs
from ..errors import MiniRunError

DEFAULT_CENTROIDS = 1024
ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}
# full-precision store keys (the 50% preset's key store, and every prompt's keys during an exact
# prefill) are float32 whatever the compute dtype, in both caches (HCACache.exact_keys)
EXACT_KEY_ELEM = 4


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


def value_elem_bytes(dtype: str) -> int:
    """The host value pool is float32 for float32 runs, float16 otherwise."""
    return 4 if dtype == "float32" else 2


def on_cpu(cfg: EngineConfig) -> bool:
    """Whether the engine of this config runs on the CPU ("auto" without a CUDA device)."""
    import torch
    return cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())


def hca_tier_bytes(args: ModelArgs, cfg: EngineConfig, ctx: int) -> dict:
    """name -> (bytes, "device" | "host") for an HCA cache holding `ctx` tokens."""
    lay = resolve_layout(args, cfg)
    L, Hkv, Hq, hd, e = args.num_hidden_layers, args.num_key_value_heads, args.num_attention_heads, args.head_dim, ELEM[cfg.dtype]
    n_exact = cfg.sinks + cfg.window
    n_store = max(0, ctx - n_exact)
    key_bytes = hd * EXACT_KEY_ELEM if lay.exact_keys else lay.groups * lay.index_bytes
    # (on a GPU the exact tier has one spare row per layer and kv-head: the decode step's own token)
    pool = L * Hkv * n_store * hd * value_elem_bytes(cfg.dtype)     # host rows of the store, values or keys
    tiers = {
        "sinks+ring K+V": (2 * L * Hkv * (n_exact + (0 if on_cpu(cfg) else 1)) * hd * e, "device"),
        # two copies of sinks + ring (kv/ring_checkpoint.py: prefix reuse past the ring)
        "sinks+ring copies": (4 * L * Hkv * n_exact * hd * e, "device"),
        "key store": (L * Hkv * n_store * key_bytes, "device"),
        "value pool": (pool, "host"),
        # rescore: the store's keys beside the values, in the same type (an exact-key store has them)
        **({"host keys": (pool, "host")} if cfg.rescore and not lay.exact_keys else {}),
        # per-step scratch: approximate scores [Hq, n] f32 and selected indices [Hq, n] int32, and
        # on the CPU the integer score levels [Hq, n] uint16 (kernels_cpu.level_select)
        "scratch": (Hq * n_store * (8 + 2 * on_cpu(cfg)), "device"),
    }
    if lay.exact_keys and on_cpu(cfg):
        tiers["decode scratch"] = (cpu_decode_scratch_bytes(args, lay), "device")
    if not lay.exact_keys:
        cb = L * Hkv * lay.groups * lay.centroids * lay.sub_dim * 4     # (pairs: the product codebooks)
        if on_cpu(cfg):
            if lay.pairs:   # the 16-centroid factors, their transposed copy and norms (the encoder's)
                G, _, ds = lay.codebook_geometry
                copies = L * Hkv * G * 16 * (2 * ds + 1) * 4
            else:           # the encoder's centroid norms
                copies = L * Hkv * lay.groups * lay.centroids * 4
            if not fast_scan(lay):   # the LUT kernel's transposed copy
                copies += cb
            cb += copies
            tiers["decode scratch"] = (cpu_decode_scratch_bytes(args, lay), "device")
        tiers["codebooks"] = (cb, "device")
    return tiers


def fast_scan(lay: HCALayout) -> bool:
    """Whether the CPU cache scores this layout with kernels_cpu.fastscan (nibble pairs on AVX2)."""
    if not lay.pairs:
        return False
    from kernels_cpu.fastscan import available
    return available()


def cpu_decode_scratch_bytes(args: ModelArgs, lay: HCALayout) -> int:
    """Fixed scratch of the CPU decode step (HCACache._decode_scratch): the lookup table f32
    [Hq, g, c], its packed uint64 tables [R, g, c] (R = Hkv x ceil(query heads per kv-head / 4)) with
    per-head scale, offset (f32), top, shift (int64), the level-bucket counts int32
    [Numba threads, Hq, 4096], and the ring-key codes encoded ahead [L, Hkv, 1, g]. With exact keys
    (kernels_cpu.exact_step) only the bucket counts."""
    import math

    import numba
    from kernels_cpu.level_select import NB
    L, Hkv, Hq = args.num_hidden_layers, args.num_key_value_heads, args.num_attention_heads
    hist = numba.config.NUMBA_NUM_THREADS * Hq * NB * 4
    if lay.exact_keys:
        return hist
    if fast_scan(lay):   # kernels_cpu.fastscan.FastScanLUT: T f32 and tabs uint8 [Hq, G, 16], 4 per-head arrays
        G = lay.codebook_geometry[0]
        return Hq * G * 16 * 5 + Hq * (4 + 4 + 8 + 8) + hist + L * Hkv * lay.groups
    g, c = lay.groups, lay.centroids
    R = Hkv * math.ceil(Hq // Hkv / 4)
    return (Hq * g * c * 4 + R * g * c * 8 + Hq * (4 + 4 + 8 + 8)
            + numba.config.NUMBA_NUM_THREADS * Hq * NB * 4 + L * Hkv * g * lay.index_bytes)
