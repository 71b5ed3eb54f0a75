"""Memory planning: the bytes of every tier for (model, ctx, kv policy, dtype), checked before allocating."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .config import EngineConfig, ModelArgs
from .errors import ContextError

GiB = 1 << 30
ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Plan:
    tiers: dict          # name -> (bytes, "device" | "host")
    ctx: int

    def bytes_on(self, where: str) -> int:
        return sum(b for b, w in self.tiers.values() if w == where)


def weight_bytes(args: ModelArgs, dtype: str) -> int:
    D, F, L, V = args.hidden_size, args.intermediate_size, args.num_hidden_layers, args.vocab_size
    hd, Hq, Hkv = args.head_dim, args.num_attention_heads, args.num_key_value_heads
    per_layer = D * (Hq + 2 * Hkv) * hd + Hq * hd * D + 3 * D * F + 2 * D
    n = L * per_layer + V * D * (1 if args.tie_word_embeddings else 2) + D
    return n * ELEM[dtype]


def plan(args: ModelArgs, cfg: EngineConfig, ctx: int | None = None) -> Plan:
    """Tier sizes for a context of `ctx` tokens (default cfg.ctx)."""
    ctx = cfg.ctx if ctx is None else ctx
    L, Hkv, hd, e = args.num_hidden_layers, args.num_key_value_heads, args.head_dim, ELEM[cfg.dtype]
    tiers = {"weights": (weight_bytes(args, cfg.dtype), "device")}
    if cfg.kv == "dense":
        tiers["dense K+V"] = (2 * L * Hkv * hd * e * ctx, "device")
    else:
        from .kv.hca_layout import hca_tier_bytes
        tiers.update(hca_tier_bytes(args, cfg, ctx))
    return Plan(tiers, ctx)


def available_bytes(device: torch.device) -> dict:
    """Free bytes now: {"host": MemAvailable, "device": free GPU memory (or host when on CPU)}."""
    host = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
    except OSError:
        pass
    if host is None:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    dev = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    return {"host": host, "device": dev}


def largest_ctx(args: ModelArgs, cfg: EngineConfig, device: torch.device, avail: dict) -> int:
    """The largest ctx whose plan fits `avail` (bisection over the monotone plan)."""
    lo, hi = 0, 1 << 34
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(plan(args, cfg, mid), device, avail):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _fits(p: Plan, device: torch.device, avail: dict) -> bool:
    if device.type == "cuda":
        return p.bytes_on("device") <= avail["device"] and p.bytes_on("host") <= avail["host"]
    return p.bytes_on("device") + p.bytes_on("host") <= avail["host"]


def check_fits(args: ModelArgs, cfg: EngineConfig, device: torch.device, avail: dict | None = None) -> Plan:
    """Raise ContextError (one line, with what would fit) when cfg.ctx cannot be held."""
    avail = avail or available_bytes(device)
    p = plan(args, cfg)
    if _fits(p, device, avail):
        return p
    best = largest_ctx(args, cfg, device, avail)
    where = "GPU" if device.type == "cuda" else "host"
    need = p.bytes_on("device") + (0 if device.type == "cuda" else p.bytes_on("host"))
    have = avail["device"] if device.type == "cuda" else avail["host"]
    hint = " or --kv hca" if cfg.kv == "dense" else ""
    raise ContextError(f"--ctx {cfg.ctx} needs {need / GiB:.1f} GiB of {where} memory for kv={cfg.kv} "
                       f"but {have / GiB:.1f} GiB is free: the largest context that fits is {best}"
                       f" (use --ctx {best}{hint})")


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def plan_report(args: ModelArgs, cfg: EngineConfig, device: str, gpu_mem: int | None = None) -> dict:
    """The plan as a dict: tiers with bytes and bytes/token, totals per place, fit verdict, largest ctx."""
    p = plan(args, cfg)
    tiers = []
    for name, (nbytes, where) in p.tiers.items():
        per_tok = None
        if name in ("dense K+V", "key store", "value pool") and cfg.ctx:
            n_tok = cfg.ctx if name == "dense K+V" else max(0, cfg.ctx - cfg.sinks - cfg.window)
            per_tok = nbytes / n_tok if n_tok else 0
        if device == "cpu":
            where = "host"
        tiers.append({"tier": name, "where": where, "bytes": nbytes, "bytes_per_token": per_tok})
    dev = torch.device(device)
    avail = {"host": available_bytes(torch.device("cpu"))["host"], "device": None}
    if device == "cuda":
        if gpu_mem is not None:
            avail["device"] = gpu_mem
        elif torch.cuda.is_available():
            avail["device"] = torch.cuda.mem_get_info()[0]
    report = {"ctx": cfg.ctx, "kv": cfg.kv, "kv_budget": cfg.kv_budget if cfg.kv == "hca" else None,
              "dtype": cfg.dtype, "device": device, "tiers": tiers,
              "device_bytes": p.bytes_on("device") if device == "cuda" else 0,
              "host_bytes": p.bytes_on("host") + (0 if device == "cuda" else p.bytes_on("device")),
              "available": avail}
    if device == "cuda" and avail["device"] is None:
        report["fits"] = None
        report["note"] = "no GPU here to read free memory from: pass --gpu-mem (e.g. 80G) to check"
    else:
        report["fits"] = _fits(p, dev, avail)
        report["largest_ctx"] = largest_ctx(args, cfg, dev, avail)
    return report


def format_plan(r: dict) -> str:
    lines = [f"plan: ctx {r['ctx']}, kv {r['kv']}" + (f" {r['kv_budget']}" if r["kv_budget"] else "")
             + f", {r['dtype']}, {r['device']}", "",
             "| tier | where | bytes | size | bytes/token |", "|---|---|---|---|---|"]
    for t in r["tiers"]:
        per = "-" if t["bytes_per_token"] is None else f"{t['bytes_per_token']:.0f}"
        lines.append(f"| {t['tier']} | {t['where']} | {t['bytes']} | {format_bytes(t['bytes'])} | {per} |")
    lines.append("")
    if r["device"] == "cuda":
        lines.append(f"GPU total: {format_bytes(r['device_bytes'])}")
    lines.append(f"host total: {format_bytes(r['host_bytes'])}")
    if r["fits"] is None:
        lines.append(r["note"])
    else:
        av = r["available"]
        where = f"host {format_bytes(r['host_bytes'])} of {format_bytes(av['host'])} available"
        if r["device"] == "cuda":
            where = f"GPU {format_bytes(r['device_bytes'])} of {format_bytes(av['device'])}, " + where
        lines.append(f"{'fits' if r['fits'] else 'does NOT fit'}: {where} "
                     f"(largest ctx that fits: {r['largest_ctx']})")
    return "\n".join(lines)
