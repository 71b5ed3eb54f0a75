"""Product-quantization codebooks for keys: fitting (mini-batch k-means in torch), saving, loading.

C[layer, kv_head, group, centroid, sub_dim]: every (layer, kv-head, group) has its own codebook
(the paper's Table 4 "*" variant, which it found consistently more accurate than a shared one).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError


def codebook_filename(groups: int, centroids: int, unrotated: bool = False) -> str:
    """unrotated: codebooks of keys without their RoPE rotation, for far positions (kv/far_positions.py)."""
    return f"codebooks-g{groups}-c{centroids}{'-unrotated' if unrotated else ''}.safetensors"


def _assign(x: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """x [B, m, ds], C [B, c, ds] -> nearest centroid [B, m] (squared L2, ties to the lowest index).

    On the CPU this is the Numba encode kernel (each problem as one "head" with one group: no
    [B, m, c] distance matrix is materialized, ~50x faster than torch); elsewhere one fused baddbmm.
    """
    if x.device.type == "cpu":
        import kernels_cpu
        P = kernels_cpu.encode_keys(x.contiguous().numpy(), C[:, None].contiguous().numpy())
        return torch.from_numpy(P[..., 0].astype("int64"))
    return torch.baddbmm((C * C).sum(-1)[:, None, :], x, C.transpose(1, 2), alpha=-2.0).argmin(-1)


def fit_kmeans(x: torch.Tensor, c: int, iters: int = 60, batch: int = 4096, seed: int = 0,
               progress=None, max_elems: int = 1 << 26) -> torch.Tensor:
    """Mini-batch k-means (Sculley 2010) for B independent problems at once.

    x: [B, n, ds] float32 samples -> centroids [B, c, ds]. Centroids start at distinct random
    samples; each step assigns a random mini-batch and moves each centroid towards its members
    with a per-centroid rate 1/count. Problems are processed in slices of at most `max_elems`
    distance entries so memory stays bounded.
    progress: optional callable(done_steps, total_steps).
    """
    B, n, ds = x.shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    if n < c:   # fewer samples than centroids: repeat samples (duplicates become identical centroids)
        x = x.repeat(1, (c + n - 1) // n, 1)
        n = x.shape[1]
    m = min(batch, n)
    slice_b = B if x.device.type == "cpu" else max(1, min(B, max_elems // (m * c)))
    out = torch.empty(B, c, ds, dtype=torch.float32, device=x.device)
    total, done = iters * ((B + slice_b - 1) // slice_b), 0
    for b0 in range(0, B, slice_b):
        xb = x[b0:b0 + slice_b].float()
        nb = xb.shape[0]
        init = torch.stack([torch.randperm(n, generator=g)[:c] for _ in range(nb)]).to(x.device)
        C = torch.gather(xb, 1, init[..., None].expand(nb, c, ds)).clone()
        counts = torch.zeros(nb, c, device=x.device)
        for _ in range(iters):
            pick = torch.randint(0, n, (nb, m), generator=g).to(x.device)
            xs = torch.gather(xb, 1, pick[..., None].expand(nb, m, ds))
            a = _assign(xs, C)                                                   # [nb, m]
            sums = torch.zeros(nb, c, ds, device=x.device).scatter_add_(1, a[..., None].expand(nb, m, ds), xs)
            cnt = torch.zeros(nb, c, device=x.device).scatter_add_(1, a, torch.ones_like(a, dtype=torch.float32))
            counts += cnt
            rate = torch.where(counts > 0, cnt / counts.clamp(min=1), torch.zeros_like(cnt))[..., None]
            C += rate * (sums / cnt.clamp(min=1)[..., None] - C)
            done += 1
            if progress:
                progress(done, total)
        out[b0:b0 + nb] = C
    return out


def pair_product(C: np.ndarray) -> np.ndarray:
    """Factor codebooks of 16 centroids C [..., G, 16, ds] -> the product codebooks of their pairs
    [..., G/2, 256, 2 ds]: centroid a | b << 4 of pair p is (C[2p, a], C[2p + 1, b]) side by side.
    The cache stores two 4-bit codes per byte, and a byte is an index into this codebook
    (kernels_cpu.fastscan)."""
    C = np.asarray(C, np.float32)
    *lead, G, c, ds = C.shape
    a = np.broadcast_to(C[..., 0::2, None, :, :], (*lead, G // 2, 16, 16, ds))   # [.., p, b, a, ds]
    b = np.broadcast_to(C[..., 1::2, :, None, :], (*lead, G // 2, 16, 16, ds))
    return np.ascontiguousarray(np.concatenate([a, b], -1).reshape(*lead, G // 2, 256, 2 * ds))


class Codebooks:
    """centroids [L, Hkv, g, c, ds] float32 (on the device where scoring runs)."""

    def __init__(self, centroids: torch.Tensor, source: str = "fitted"):
        self.centroids = centroids
        self.source = source   # "calibrated:<file>" or "prompt"
        self.factors = None    # paired(): the 16-centroid codebooks of the pairs

    @property
    def shape(self):
        return tuple(self.centroids.shape)

    @property
    def nbytes(self) -> int:
        """The centroids' bytes, and the factors' when paired() kept them."""
        return sum(t.numel() * t.element_size() for t in (self.centroids, self.factors) if t is not None)

    def paired(self) -> "Codebooks":
        """These codebooks (16 centroids, an even number of groups) as the product codebooks of
        their group pairs (pair_product), the layout of a cache of nibble-pair codes; `factors`
        keeps the 16-centroid codebooks [L, Hkv, G, 16, ds] the fast-scan kernels read."""
        out = Codebooks(torch.from_numpy(pair_product(self.centroids.cpu().numpy())).to(self.centroids.device),
                        self.source)
        out.factors = self.centroids
        return out

    @classmethod
    def fit(cls, keys: torch.Tensor, groups: int, centroids: int, iters: int = 60, seed: int = 0,
            progress=None, source: str = "prompt") -> "Codebooks":
        """keys [L, Hkv, n, hd] post-RoPE keys -> per-(layer, kv-head, group) codebooks."""
        L, Hkv, n, hd = keys.shape
        ds = hd // groups
        x = keys.float().reshape(L, Hkv, n, groups, ds).permute(0, 1, 3, 2, 4).reshape(L * Hkv * groups, n, ds)
        C = fit_kmeans(x.contiguous(), centroids, iters=iters, seed=seed, progress=progress)
        return cls(C.reshape(L, Hkv, groups, centroids, ds), source)

    def save(self, path: str | Path, meta: dict | None = None, extra: dict | None = None) -> Path:
        """extra: more tensors for the file (the per-head selection budgets: minirun/kv/head_budgets.py)."""
        from safetensors.torch import save_file
        path = Path(path)
        tmp = path.with_suffix(".tmp")
        L, Hkv, g, c, ds = self.shape
        info = {"layers": L, "kv_heads": Hkv, "groups": g, "centroids": c, "sub_dim": ds, **(meta or {})}
        save_file({"centroids": self.centroids.cpu().contiguous(), **(extra or {})}, str(tmp),
                  metadata={k: json.dumps(v) for k, v in info.items()})
        tmp.replace(path)   # atomic: never a half-written codebook file
        return path

    @classmethod
    def load(cls, path: str | Path, expect: tuple, device="cpu") -> "Codebooks":
        """expect: (L, Hkv, g, c, ds); any mismatch or corruption is a one-line CheckpointError."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        path = Path(path)
        try:
            C = load_file(str(path))["centroids"]
        except (SafetensorError, OSError, KeyError, ValueError) as e:
            raise CheckpointError(f"codebook file {path.name} is unreadable ({e})") from None
        if tuple(C.shape) != tuple(expect):
            raise CheckpointError(f"codebook file {path.name} has shape {tuple(C.shape)}, this model and "
                                  f"setting need {tuple(expect)} (layers, kv-heads, groups, centroids, sub-dim)")
        if not torch.isfinite(C).all():
            raise CheckpointError(f"codebook file {path.name} holds non-finite values")
        return cls(C.float().to(device), f"calibrated:{path.name}")
