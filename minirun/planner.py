"""Memory planning: the bytes of every tier for (model, ctx, kv policy, dtype), checked before allocating."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from .config import MAX_CTX, EngineConfig, ModelArgs
from .errors import ContextError
from .kv.hca_layout import ELEM
from .kv.layer_kinds import global_args, layer_split
from .kv.sliding import ring_slots
from .quant.sizes import weights_label

GiB = 1 << 30
PREFILL_KEYS = "prompt keys (prefill)"     # transient tiers: see prefill_transient_tiers
PREFILL_VALUES = "prompt values (prefill)"
ANCHOR_BLOCK = "anchor block (prefill)"
SLIDING, SLIDING_COPIES = "sliding K+V", "sliding K+V copies"     # the sliding-window layers' rings


@dataclass
class Plan:
    tiers: dict          # name -> (bytes, "device" | "host")
    ctx: int

    def bytes_on(self, where: str) -> int:
        return sum(b for b, w in self.tiers.values() if w == where)


def param_count(args: ModelArgs) -> int:
    """Parameters of the checkpoint (projections, norms, embedding and, when untied, the LM head)."""
    D, F, L, V = args.hidden_size, args.intermediate_size, args.num_hidden_layers, args.vocab_size
    hd, Hq, Hkv = args.head_dim, args.num_attention_heads, args.num_key_value_heads
    per_layer = D * (Hq + 2 * Hkv) * hd + Hq * hd * D + 3 * D * F + 2 * D
    return L * per_layer + V * D * (1 if args.tie_word_embeddings else 2) + D


def weight_bytes(args: ModelArgs, dtype: str, weights: str = "stored") -> int:
    """The weights' bytes as held: float tensors in `dtype`, block-quantized matrices (stored so, or
    quantized at load by --weights) at their format's size."""
    from .quant.sizes import weight_bytes as held_bytes
    return held_bytes(args, param_count(args), ELEM[dtype], weights)


def prefill_transient_tiers(args: ModelArgs, cfg: EngineConfig, ctx: int) -> dict:
    """HCA buffers that live only while a prompt is prefilled (or until codebooks are fitted), at
    their peak: name -> (bytes, "device" | "host"); empty for dense and for exact-key layouts. The
    buffers are kv/hca_layout.prefill_buffers' (what the caches allocate), here at the rows a
    prefill fills:

    - prompt keys (float32; host with the CPU kernels, device with the CUDA ones): an exact prefill
      keeps every store token's full-precision key until end_prefill encodes them (auto mode
      prefills exactly up to exact_prefill_max tokens); without calibrated codebooks, keys are also
      kept until fit_min_tokens of them (plus one chunk) are there to fit on. The planner cannot
      tell whether codebooks are calibrated: it counts them.
    - prompt values (GPU, exact prefill): the store's values on the device beside its keys.
    - anchor block: an anchor prefill's exact copy of the first anchor_tokens keys (and, on a GPU,
      values) on the device.
    Where auto mode may take either path, each figure is the larger of the two (conservative).
    """
    if cfg.kv != "hca":
        return {}
    from .kv.hca_layout import on_cpu, prefill_buffers, resolve_layout
    if resolve_layout(args, cfg).exact_keys:
        return {}
    cpu = on_cpu(cfg)
    bufs = prefill_buffers(args, ctx, cfg.sinks, cfg.window, cfg.anchor_tokens, getattr(torch, cfg.dtype),
                           "cpu" if cpu else "cuda")
    n_store = bufs["exact_keys"].rows
    until_fit = min(n_store, cfg.fit_min_tokens + cfg.chunk_for("cpu" if cpu else "cuda"))
    mode = cfg.prefill_mode
    if mode == "auto":
        limit = cfg.exact_prefill_limit("cpu" if cpu else "cuda", args.max_position_embeddings)
        exact_rows = min(n_store, max(0, limit - cfg.sinks - cfg.window))
        rows, uses_anchor = max(until_fit, exact_rows), ctx > limit
    else:
        exact_rows = n_store if mode == "exact" else 0
        rows, uses_anchor = max(until_fit, exact_rows), mode == "anchor"

    def at(name, r):
        b = bufs.get(name)
        return 0 if b is None or not b.rows else b.nbytes // b.rows * r

    tiers = {}
    if rows:
        tiers[PREFILL_KEYS] = (at("exact_keys", rows), "host" if cpu else "device")
    if exact_rows and not cpu:
        tiers[PREFILL_VALUES] = (at("prefill_values", exact_rows), "device")
    if uses_anchor and bufs["anchor_k"].rows:
        tiers[ANCHOR_BLOCK] = (bufs["anchor_k"].nbytes + (0 if cpu else bufs["anchor_v"].nbytes), "device")
    return tiers


def plan(args: ModelArgs, cfg: EngineConfig, ctx: int | None = None) -> Plan:
    """Tier sizes for a context of `ctx` tokens (default cfg.ctx): a model's sliding-window layers
    hold a ring of their window and two copies of it (kv/sliding.py), its other layers the cache
    cfg.kv names."""
    ctx = cfg.ctx if ctx is None else ctx
    e = ELEM[cfg.dtype]
    tiers = {"weights": (weight_bytes(args, cfg.dtype, cfg.weights), "device")}
    sliding, full = layer_split(args)
    if sliding:
        ring = 2 * len(sliding) * args.num_key_value_heads * args.head_dim * e * ring_slots(args.sliding_window, ctx)
        tiers[SLIDING] = (ring, "device")
        tiers[SLIDING_COPIES] = (2 * ring, "device")
    ga = global_args(args) if sliding and full else args
    if full and cfg.kv == "dense":
        tiers["dense K+V"] = (2 * len(full) * ga.num_key_value_heads * ga.head_dim * e * ctx, "device")
    elif full:
        from .kv.hca_layout import hca_tier_bytes
        tiers.update(hca_tier_bytes(ga, cfg, ctx))    # (exact keys: float32, as the caches store them)
        tiers.update(prefill_transient_tiers(ga, cfg, ctx))
    if cfg.parallel > 1:     # each sequence its own cache (minirun serve --parallel)
        tiers = {k: (b if k == "weights" else b * cfg.parallel, where) for k, (b, where) in tiers.items()}
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
    lo, hi = 0, MAX_CTX
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
    if cfg.kv != "dense" and not layer_split(args)[1]:
        raise ContextError(f"every layer of this model attends over a sliding window of {args.sliding_window} "
                           f"tokens: there is no long context for --kv {cfg.kv} to hold (use --kv dense)")
    avail = avail or available_bytes(device)
    p = plan(args, cfg)
    if _fits(p, device, avail):
        return p
    best = largest_ctx(args, cfg, device, avail)
    where = "GPU" if device.type == "cuda" else "host"
    need = p.bytes_on("device") + (0 if device.type == "cuda" else p.bytes_on("host"))
    have = avail["device"] if device.type == "cuda" else avail["host"]
    hint = " or --kv hca" if cfg.kv == "dense" else ""
    head = (f"--ctx {cfg.ctx} needs {format_bytes(need)} of {where} memory for kv={cfg.kv} but "
            f"{format_bytes(have)} is free")
    if cfg.parallel > 1:
        head = f"--parallel {cfg.parallel} x " + head
        fewer = next((n for n in range(cfg.parallel - 1, 0, -1)
                      if _fits(plan(args, dataclasses.replace(cfg, parallel=n)), device, avail)), 0)
        hint += f", or --parallel {fewer}" if fewer else ""
    if best == 0:
        raise ContextError(f"{head}: {what_never_fits(args, cfg, device, avail)}")
    raise ContextError(f"{head}: the largest context that fits is {best} (use --ctx {best}{hint})")


def what_never_fits(args: ModelArgs, cfg: EngineConfig, device: torch.device, avail: dict) -> str:
    """Why no context at all fits `avail` (largest_ctx is 0), naming the part that does not: the
    model's weights, or an HCA cache's exact sinks and window (held whole whatever the context)."""
    cuda = device.type == "cuda"
    p = plan(args, cfg, 1)
    have = avail["device"] if cuda else avail["host"]
    weights = p.tiers["weights"][0]
    if weights > have:
        return (f"the model itself does not fit at any context: its weights need {format_bytes(weights)} "
                f"({param_count(args)} parameters, vocab_size {args.vocab_size})")
    exact = sum(b for name, (b, _) in p.tiers.items() if name.startswith("sinks+ring"))
    if cfg.kv == "hca" and exact + weights > have:
        what = f"--window {cfg.window}" if cfg.window >= cfg.sinks else f"--sinks {cfg.sinks}"
        return (f"{what} does not fit at any context: the {cfg.sinks + cfg.window} tokens kept exact "
                f"(--sinks {cfg.sinks} + --window {cfg.window}) need {format_bytes(exact)} beside the weights' "
                f"{format_bytes(weights)}: give a smaller {what.split()[0]}")
    return (f"not even a context of 1 token fits: the weights and fixed buffers need "
            f"{format_bytes(p.bytes_on('device') + (0 if cuda else p.bytes_on('host')))}")


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


PER_TOKEN_TIERS = ("dense K+V", "key store", "value pool", "host keys", "scratch")   # tiers that grow with the context


def hca_setting_of(args: ModelArgs, cfg: EngineConfig):
    """The key-store setting as the tools name it: the budget preset (0.125), "gGcC" when codebooks
    are given explicitly (g64c16), None for dense."""
    if cfg.kv != "hca":
        return None
    if cfg.groups is None and cfg.centroids is None:
        return cfg.kv_budget
    from .kv.hca_layout import resolve_layout
    g, c = resolve_layout(args, cfg).codebook_geometry[:2]
    return f"g{g}c{c}"


def prompt_cache_bytes(args: ModelArgs, cfg: EngineConfig) -> int:
    """A prompt-cache file of a context filled to cfg.ctx (minirun/prompt_cache.py, kv/state.py),
    less its header: dense K+V, or sinks + ring (no spare row), key store, value pool (and host
    keys with rescore) and the codebooks as the cache keeps them (the CPU: the fitted or calibrated ones; the GPU: their
    product form for nibble pairs), plus 8 B per token id and ring slot."""
    tiers = plan(args, cfg).tiers
    ring = tiers.get(SLIDING, (0,))[0]
    if cfg.kv == "dense":
        return tiers.get("dense K+V", (0,))[0] + ring + 8 * cfg.ctx
    from .kv.hca_layout import on_cpu, resolve_layout
    ga = global_args(args) if ring else args
    lay = resolve_layout(ga, cfg)
    L, Hkv, hd = ga.num_hidden_layers, ga.num_key_value_heads, ga.head_dim
    n_exact = cfg.sinks + cfg.window
    G, C, ds = lay.codebook_geometry if on_cpu(cfg) else (lay.groups, lay.centroids, lay.sub_dim)
    codebooks = 0 if lay.exact_keys else L * Hkv * G * C * ds * 4
    return (2 * L * Hkv * n_exact * hd * ELEM[cfg.dtype] + tiers["key store"][0] + tiers["value pool"][0]
            + tiers.get("host keys", (0,))[0] + codebooks + ring + 8 * (cfg.ctx + n_exact))


def plan_report(args: ModelArgs, cfg: EngineConfig, device: str, gpu_mem: int | None = None,
                host_mem: int | None = None) -> dict:
    """The plan as a dict (what `minirun plan -o json` prints).

    Keys: ctx, kv, kv_budget (hca_setting_of: 0.125 or "g64c16"; None for dense), dtype, device ("cpu" | "cuda"), params,
    tiers [{tier, where ("device" | "host"), bytes, bytes_per_token (None where it does not grow
    per token: weights, sinks+ring, codebooks, prefill-only buffers), transient (bool: held only
    while a prompt is prefilled)}], device_bytes, host_bytes (totals per place; on cpu everything
    is host), dense_bytes_per_token (dense K+V in this dtype, for comparison), available
    {host, device} (bytes free now; host: --host-mem, else this machine's available memory; device:
    --gpu-mem, the GPU's free memory, or None),
    fits (bool, or None when there is no GPU figure to check against: see note), host_fits,
    largest_ctx (on the device planned for; None when there is no GPU figure), prompt_cache_bytes
    (prompt_cache_bytes), trained_ctx (max_position_embeddings), ctx_note (trained_ctx_note), note.
    """
    p = plan(args, cfg)
    n_store = max(0, cfg.ctx - cfg.sinks - cfg.window)
    tiers = []
    for name, (nbytes, where) in p.tiers.items():
        per_tok = None
        if name in PER_TOKEN_TIERS:
            n_tok = cfg.ctx if name == "dense K+V" else n_store
            per_tok = (nbytes // n_tok if nbytes % n_tok == 0 else nbytes / n_tok) if n_tok else 0
        tiers.append({"tier": name, "where": "host" if device == "cpu" else where, "bytes": nbytes,
                      "bytes_per_token": per_tok, "transient": name in (PREFILL_KEYS, PREFILL_VALUES, ANCHOR_BLOCK)})
    dev = torch.device(device)
    avail = {"host": host_mem if host_mem is not None else available_bytes(torch.device("cpu"))["host"],
             "device": None}
    if device == "cuda":
        if gpu_mem is not None:
            avail["device"] = gpu_mem
        elif torch.cuda.is_available():
            avail["device"] = torch.cuda.mem_get_info()[0]
    dense_tok = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * ELEM[cfg.dtype]
    host_bytes = p.bytes_on("host") + (0 if device == "cuda" else p.bytes_on("device"))
    report = {"ctx": cfg.ctx, "kv": cfg.kv, "kv_budget": hca_setting_of(args, cfg),
              "dtype": cfg.dtype, "weights": weights_label(args, cfg.weights, cfg.dtype), "device": device,
              "params": param_count(args), "tiers": tiers,
              "device_bytes": p.bytes_on("device") if device == "cuda" else 0, "host_bytes": host_bytes,
              "dense_bytes_per_token": dense_tok, "available": avail, "host_fits": host_bytes <= avail["host"],
              "prompt_cache_bytes": prompt_cache_bytes(args, cfg), "trained_ctx": args.max_position_embeddings,
              "ctx_note": trained_ctx_note(args, cfg), "note": None}
    if device == "cuda" and avail["device"] is None:
        report["fits"], report["largest_ctx"] = None, None
        report["note"] = "cannot check free GPU memory: torch sees no GPU here; pass --gpu-mem (e.g. 80G)"
    else:
        report["fits"] = _fits(p, dev, avail)
        report["largest_ctx"] = largest_ctx(args, cfg, dev, avail)
        if report["largest_ctx"] == 0:
            report["note"] = what_never_fits(args, cfg, dev, avail)
    return report


def trained_ctx_note(args: ModelArgs, cfg: EngineConfig) -> str | None:
    """One line when cfg.ctx passes the context the model was trained on (max_position_embeddings)."""
    trained = args.max_position_embeddings
    if trained is None or cfg.ctx <= trained:
        return None
    how = ("chat and generate attend past it at far positions: far_positions auto, the default" if cfg.kv == "hca"
           else "--kv hca attends past it at far positions")
    return (f"--ctx {cfg.ctx} is past the {trained} tokens this model was trained on (max_position_embeddings): "
            f"answers degrade once a conversation is longer than that ({how}; docs/QUALITY.md)")


def format_plan(r: dict) -> str:
    """The report of plan_report as a markdown table and a few lines of totals and verdict."""
    budget = f" {r['kv_budget']}" if r["kv_budget"] else ""
    n = r["params"]
    params = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
    weights = "" if r.get("weights", r["dtype"]) == r["dtype"] else f"{r['weights']} weights, "
    lines = [f"plan: ctx {r['ctx']}, kv {r['kv']}{budget}, {weights}{r['dtype']}, {r['device']}, {params} params", "",
             "| tier | where | bytes | size | bytes/token |", "|---|---|---|---|---|"]
    for t in r["tiers"]:
        per = "-" if t["bytes_per_token"] is None else f"{t['bytes_per_token']:.0f}"
        lines.append(f"| {t['tier']} | {t['where']} | {t['bytes']} | {format_bytes(t['bytes'])} | {per} |")
    lines.append("")
    kv_dev = [t for t in r["tiers"] if t["tier"] in ("dense K+V", "key store") and t["bytes_per_token"]]
    if kv_dev:
        t = kv_dev[0]
        lines.append(f"{t['tier']}: {t['bytes_per_token']:.0f} B/token = "
                     f"{100 * t['bytes_per_token'] / r['dense_bytes_per_token']:.1f}% of dense K+V "
                     f"({r['dense_bytes_per_token']} B/token in {r['dtype']})")
    if any(t["transient"] for t in r["tiers"]):
        lines.append("(prefill) tiers are held only while a prompt is prefilled; totals include them")
    if r["device"] == "cuda":
        lines.append(f"GPU total: {r['device_bytes']} B ({format_bytes(r['device_bytes'])})")
    lines.append(f"host total: {r['host_bytes']} B ({format_bytes(r['host_bytes'])})")
    lines.append(f"a prompt-cache file of a full context (chat --prompt-cache): ~{format_bytes(r['prompt_cache_bytes'])} on disk")
    av = r["available"]
    if r["fits"] is None:
        lines.append(r["note"])
        if r["host_bytes"]:    # (dense on a GPU holds nothing on the host: no verdict to give there)
            lines.append(f"host side {'fits' if r['host_fits'] else 'does NOT fit'}: "
                         f"{format_bytes(r['host_bytes'])} of {format_bytes(av['host'])} available")
    else:
        host_ok = r["host_bytes"] <= av["host"]
        parts = [f"host {format_bytes(r['host_bytes'])} of {format_bytes(av['host'])} available"
                 + ("" if host_ok or r["fits"] else " (too little)")]
        if r["device"] == "cuda":
            gpu_ok = r["device_bytes"] <= av["device"]
            parts.insert(0, f"GPU {format_bytes(r['device_bytes'])} of {format_bytes(av['device'])}"
                         + ("" if gpu_ok or r["fits"] else " (too little)"))
        lines.append(f"{'fits' if r['fits'] else 'does NOT fit'}: {', '.join(parts)} "
                     + (f"(largest ctx that fits: {r['largest_ctx']})" if r["largest_ctx"] else f"({r['note']})"))
    if r.get("ctx_note"):
        lines.append(f"note: {r['ctx_note']}")
    return "\n".join(lines)
