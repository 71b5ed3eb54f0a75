"""How `minirun bench` shows its rows: a llama-bench-like markdown table, a compact one (one line per
decode variant, memory per tier), JSON, CSV (kv_stats flattened), and a plot (matplotlib, optional)."""
from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict

from .bench import FIELDS, BenchResult
from ..errors import MiniRunError
from ..planner import format_bytes


def _size(n: int) -> str:
    return format_bytes(n) if n else "-"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.2f} K"


def kv_split(stats: dict) -> tuple[int, int]:
    """(bytes in the device tiers, bytes in the host tiers) of a cache's stats()."""
    dev = stats.get("device_kv_bytes", 0) + sum(stats.get(k, 0) for k in (
        "device_keys_bytes", "device_ring_sinks_bytes", "codebook_bytes", "scratch_bytes", "decode_scratch_bytes",
        "sliding_kv_bytes", "sliding_copy_bytes"))
    host = sum(stats.get(k, 0) for k in ("host_values_bytes", "host_keys_bytes", "prefill_keys_bytes"))
    return dev, host


MD_HEAD = ["model", "size", "params", "device", "threads", "weights", "kv", "budget", "values", "codebooks", "context",
           "test", "t/s", "selected", "peak host", "peak device", "kv device", "kv host"]


def to_markdown(results: list[BenchResult]) -> str:
    """A llama-bench-like table: one header, one row per test."""
    align = ["---:" if h == "t/s" else "---" for h in MD_HEAD]
    rows = ["| " + " | ".join(MD_HEAD) + " |", "| " + " | ".join(align) + " |"]
    for r in results:
        dev, host = kv_split(r.kv_stats)
        rows.append("| " + " | ".join([
            r.model, format_bytes(r.model_bytes), _params(r.model_params), r.device, str(r.threads),
            r.dtype if r.weights in ("", r.dtype) else f"{r.weights} ({r.dtype})",
            r.kv + (" rescore" if r.rescore else "") + ("" if r.cuda_graphs == "off" else f" ({r.cuda_graphs} graphs)"), "-" if r.kv_budget is None else str(r.kv_budget), r.values or "-", r.codebooks, r.context, r.test,
            f"{r.tps_mean:.2f} ± {r.tps_std:.2f}", "-" if r.selected is None else f"{100 * r.selected:.1f}%",
            _size(r.peak_host_bytes) + ("" if r.peak_host_scope == "test" else " (process)"),
            _size(r.peak_device_bytes), _size(dev), _size(host)]) + " |")
    return "\n".join(rows)


def to_markdown_compact(rows: list[dict]) -> str:
    """A narrower table of bench rows (dicts, as to_json writes them) for one model on one device:
    one line per decode variant (where the values were summed, graphs, the cap) with memory per tier."""
    lines = ["| model | kv | budget | test | value sum | graphs | cap | t/s | selected | peak GPU | kv GPU | kv host |",
             "|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        dev, host = kv_split(r.get("kv_stats") or {})
        sel = "-" if r.get("selected") is None else f"{100 * r['selected']:.2f}%"
        lines.append("| " + " | ".join(str(x) for x in [
            r["model"] + (f" {r['weights']}" if r.get("weights", "").startswith("Q") else ""), r["kv"], r["kv_budget"] or "-", r["test"], r.get("value_sum") or "-", r["cuda_graphs"],
            r.get("max_select") or "-", f"{r['tps_mean']:.1f}", sel, _size(r["peak_device_bytes"]), _size(dev),
            _size(host)]) + " |")
    return "\n".join(lines)


def to_json(results: list[BenchResult]) -> str:
    return json.dumps([asdict(r) for r in results], indent=2)


def csv_fields(results: list[BenchResult]) -> list[str]:
    keys = sorted({k for r in results for k in r.kv_stats})
    return [f for f in FIELDS if f != "kv_stats"] + [f"kv_{k}" for k in keys]


def to_csv(results: list[BenchResult]) -> str:
    """FIELDS without kv_stats, then one kv_<key> column per stats key (empty where a mode lacks it)."""
    cols = csv_fields(results)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    for r in results:
        row = {k: v for k, v in asdict(r).items() if k != "kv_stats"}
        row["kv_budget"] = "" if r.kv_budget is None else r.kv_budget
        row["selected"] = "" if r.selected is None else r.selected
        row["samples"] = " ".join(f"{x:.3f}" for x in r.samples)
        row.update({c: r.kv_stats.get(c[3:], "") for c in cols if c.startswith("kv_") and c != "kv_budget"})
        w.writerow(row)
    return buf.getvalue()


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MiniRunError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    return plt


def check_plot() -> None:
    """Fail before benchmarking, not after, when --plot cannot be drawn."""
    _pyplot()


def plot(results: list[BenchResult], path: str) -> None:
    """tg tokens/s (mean, std as error bars) against depth, one line per KV mode."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    modes = sorted({(r.kv, r.kv_budget) for r in results if r.n_gen}, key=str)
    for kv, b in modes:
        pts = sorted((r.depth, r.tps_mean, r.tps_std) for r in results if r.n_gen and (r.kv, r.kv_budget) == (kv, b))
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3,
                    label=kv if b is None else f"{kv} {b}")
    if results:
        r = results[0]
        ax.set_title(f"{r.model} {r.dtype} {r.device}, tg{max((x.n_gen for x in results), default=0)}")
    ax.set_xlabel("context depth (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
