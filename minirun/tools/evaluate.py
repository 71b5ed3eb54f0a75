"""Quality of HCA against dense attention on the same inputs.

- perplexity: every position of a fresh sequence through the engine's cache policy (for HCA,
  `Engine.logits(prefill_mode="hca")`: each query attends exactly to sinks + ring and to the tokens
  it selects from the codebook-scored store);
- agreement: teacher forcing after a prompt (prefill, then the true continuation one token at a
  time through `Engine.step`, i.e. the decode path): top-1 agreement with dense and mean
  KL(dense || hca) of the next-token distributions;
- passkey: a 5-digit key hidden in filler at some depth; the document is prefilled, the question
  is fed through the decode path and the answer is greedy.

`run_grid` runs all three for dense and each HCA budget, one engine at a time, and `format_markdown`
renders its report; `minirun eval` and scripts/eval_quality.py are thin drivers over them.
"""
from __future__ import annotations

import contextlib
import gc
import random
import re
import time

import torch
import torch.nn.functional as F

from ..config import hca_setting, hca_setting_name
from ..errors import MiniRunError

# ---- the three measurements -------------------------------------------------------------------


def perplexity(eng, ids: list[int], chunk: int | None = None) -> float:
    """exp(mean NLL) of ids[1:] given their prefixes, every position through the engine's cache
    policy (with kv="hca": the HCA path at every position, including the first chunk's)."""
    logits = eng.logits(ids, chunk=chunk)
    nll = F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]), reduction="mean")
    return float(torch.exp(nll))


@torch.inference_mode()
def teacher_forced_logits(eng, prompt: list[int], continuation: list[int], selection: dict | None = None) -> torch.Tensor:
    """Next-token logits [len(continuation), V] (float32, CPU): row i predicts continuation[i].

    The prompt is prefilled (the engine's prefill mode), then continuation[:-1] is fed one token at
    a time with `Engine.step`. selection: a dict to receive `selection_probe`'s record of the steps.
    """
    eng.reset()
    logits, _ = eng.prefill(prompt)
    rows = [logits[-1].float().cpu()]
    with selection_probe(eng) if selection is not None else contextlib.nullcontext({}) as sel:
        for tok in continuation[:-1]:
            rows.append(eng.step(tok)[-1].float().cpu())
    if selection is not None:
        selection.update(sel)
    eng.reset()
    return torch.stack(rows)


def compare_logits(ref: torch.Tensor, out: torch.Tensor) -> dict:
    """Top-1 agreement and KL(ref || out) per position (nats) of two [n, V] logit rows."""
    lr, lo = F.log_softmax(ref.float(), -1), F.log_softmax(out.float(), -1)
    agree = (lr.argmax(-1) == lo.argmax(-1)).float()
    kl = (lr.exp() * (lr - lo)).sum(-1).clamp(min=0.0)
    return {"positions": int(ref.shape[0]), "top1_agreement": float(agree.mean()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}


def continuation_ppl(logits: torch.Tensor, continuation: list[int]) -> float:
    """exp(mean NLL) of the true continuation under teacher_forced_logits' rows (row i predicts
    continuation[i]): past the trained context, where dense attention is no reference, the measure
    that says which mode reads the long prompt best."""
    nll = F.cross_entropy(logits.float(), torch.tensor(continuation[:logits.shape[0]]), reduction="mean")
    return float(torch.exp(nll))


def agreement(ref, eng, prompt: list[int], continuation: list[int]) -> dict:
    """Teacher forcing: top-1 agreement and mean KL(ref || eng) over the len(continuation) positions
    after the prompt. ref: the reference Engine (dense), or its `teacher_forced_logits` already
    computed on the same prompt and continuation."""
    ref_logits = ref if isinstance(ref, torch.Tensor) else teacher_forced_logits(ref, prompt, continuation)
    return compare_logits(ref_logits, teacher_forced_logits(eng, prompt, continuation))


@contextlib.contextmanager
def selection_probe(eng):
    """Record, per layer and query head, the fraction of store tokens the HCA selection keeps.

    Reads the cache's own record while active (`HCACache.record_selection`: one row per layer per
    one-token step); yields a dict that holds, on exit, "fraction" [L, Hq] (mean over steps) and
    "steps". Does nothing for a dense engine.
    """
    out: dict = {}
    cache = eng.cache.full_layers if hasattr(eng, "cache") else None
    if not hasattr(cache, "record_selection"):
        yield out
        return
    L = cache.n_layers
    rows: list = []
    cache.record_selection = rows
    try:
        yield out
    finally:
        cache.record_selection = None
        steps = len(rows) // L
        if steps:
            import numpy as np
            frac = np.stack(rows[:steps * L]).reshape(steps, L, -1).mean(0)
            out.update(fraction=frac, steps=steps)


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? Answer with the number only."


def prose_haystack(eng, text_ids: list[int], n_tokens: int, copies: int = 1) -> str:
    """About n_tokens of real text: the first n_tokens / copies tokens of text_ids, `copies` times
    (joined by blank lines): the 4M run's shape (a book repeated to length) at any size."""
    per_copy = max(1, n_tokens // max(1, copies))
    chunk = eng.detokenize(text_ids[:per_copy]).strip()
    end = max(chunk.rfind("\n"), chunk.rfind(". ") + 1)        # (the last whole line or sentence)
    chunk = chunk[:end].rstrip() if end > len(chunk) // 2 else chunk
    return "\n\n".join([chunk] * max(1, copies))


def passkey_prompt(eng, n_tokens: int, depth: float, key: int, haystack: str | None = None) -> tuple[list[int], int]:
    """A chat prompt of about n_tokens: filler (or the given haystack text, cut to length at a line
    or sentence end) with the key sentence at `depth` (0..1 of it), then the question. Returns (ids,
    where the question starts: ids[q:] are fed through the decode path)."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    overhead = len(eng.chat_prompt([{"role": "user", "content": needle + "\n\n" + QUESTION}]))
    if haystack is None:
        unit = len(eng.tokenize(FILLER, add_bos=False))
        reps = max(0, (n_tokens - overhead) // unit)
        before = int(round(reps * depth))
        body = FILLER * before + needle + FILLER * (reps - before)
    else:
        at = min(len(haystack), max(0, int(len(haystack) * depth)))
        nl, dot = haystack.rfind("\n", 0, at), haystack.rfind(". ", 0, at)
        cut = at if at == len(haystack) else max(nl + 1 if nl >= 0 else 0, dot + 1 if dot >= 0 else 0)
        body = haystack[:cut] + needle + haystack[cut:]
    messages = [{"role": "user", "content": body + "\n\n" + QUESTION}]
    ids = eng.chat_prompt(messages)
    text = eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    head = text[:text.rfind(QUESTION)]
    bos = eng.tokenizer.bos_token
    head_ids = eng.tokenize(head, add_bos=not (bos and text.startswith(bos)) and eng.tokenizer.add_bos)
    q = len(head_ids) if ids[:len(head_ids)] == head_ids else max(1, len(ids) - 24)
    return ids, q


@torch.inference_mode()
def answer(eng, ids: list[int], q: int, max_new_tokens: int = 10) -> str:
    """Prefill ids[:q], feed ids[q:] one token at a time, then decode greedily (EOS stops)."""
    eng.reset()
    logits, _ = eng.prefill(ids[:q])
    for tok in ids[q:]:
        logits = eng.step(tok)
    eos = set(eng.tokenizer.eos_ids) | set(eng.args.eos_ids)
    out = []
    for _ in range(max_new_tokens):
        tok = int(logits[-1].argmax())
        if tok in eos:
            break
        out.append(tok)
        logits = eng.step(tok)
    eng.reset()
    return eng.detokenize(out)


def passkey(eng, lengths: list[int], depths: list[float], trials: int = 1, seed: int = 0,
            max_new_tokens: int = 10, text_ids: list[int] | None = None, copies: int = 1) -> list[dict]:
    """Greedy retrieval of a 5-digit key hidden in filler; one row per (length, depth).

    text_ids: hide it in real text instead (prose_haystack: the text's start, `copies` times).
    The keys depend only on seed and the cell, so every engine sees the same prompts. A trial
    succeeds when the key's digits appear in the answer's digits.
    """
    rows = []
    for n in lengths:
        hay = None
        if text_ids is not None:
            overhead = len(eng.chat_prompt([{"role": "user", "content": QUESTION}])) + 24
            hay = prose_haystack(eng, text_ids, n - overhead, copies)
        for depth in depths:
            rng = random.Random(f"{seed}-{n}-{depth}")
            ok, answers = 0, []
            for _ in range(trials):
                key = rng.randint(10000, 99999)
                ids, q = passkey_prompt(eng, n, depth, key, haystack=hay)
                if len(ids) + max_new_tokens > eng.config.ctx:
                    raise MiniRunError(f"a passkey prompt of {len(ids)} tokens + {max_new_tokens} answer tokens "
                                       f"exceeds the context of {eng.config.ctx}")
                out = answer(eng, ids, q, max_new_tokens)
                hit = str(key) in re.sub(r"\D", "", out)
                ok += hit
                answers.append({"key": key, "answer": out.strip(), "ok": bool(hit), "tokens": len(ids)})
            rows.append({"length": n, "depth": depth, "trials": trials, "accuracy": ok / trials, "answers": answers})
    return rows


# ---- the grid -----------------------------------------------------------------------------------

TARGETS = {  # budget -> (max ppl increase vs dense, min top-1 agreement, passkey equal to dense where it succeeds)
    0.25: (0.02, 0.95, True),
    0.125: (0.05, None, False),
}


def mode_name(budget: float | str | None) -> str:
    """None -> "dense"; a budget or explicit codebooks (config.hca_setting) -> "hca 0.125", "hca g64c16"."""
    return "dense" if budget is None else f"hca {hca_setting_name(budget)}"


def run_grid(model, ids: list[int], budgets=(0.5, 0.25, 0.125), ppl_tokens: int = 4096,
             prompt_tokens: int = 3072, positions: int = 256, lengths=(1024, 2048, 4096, 8000),
             depths=(0.1, 0.5, 0.9), trials: int = 2, tau: float = 0.9, window: int = 256, sinks: int = 16,
             dtype: str = "float32", key_store: str = "codebook", centroids: int | None = None, threads=None,
             seed: int = 0, far_positions: str = "auto", max_select: int | None = None, length_scale: str = "off",
             rescore: bool = False, passkey_haystack: str = "filler", passkey_copies: int = 1, kv_values=("float",),
             log=print) -> dict:
    """Dense, then HCA at each budget, on the same token ids; one engine loaded at a time.

    ids: the evaluation text's tokens (perplexity on ids[:ppl_tokens]; agreement after the prompt
    ids[:prompt_tokens] over the next `positions` tokens). 0 / empty skips a measurement.
    passkey_haystack: "filler" (the classic task) or "text" (the key hidden in the evaluation text's
    start, repeated passkey_copies times: evaluate.passkey's text_ids).
    centroids: codebook size for the codebook budgets (default: the preset's 1024). kv_values: the
    store's value types, each budget run with each ("hca 0.25", "hca 0.25 q4 values", ...).
    Returns {"settings", "rows": [one per mode]}; the dense row (the reference) comes first.
    """
    from ..engine import Engine
    need_text = max(ppl_tokens, prompt_tokens + positions if positions else 0)
    if len(ids) < need_text:
        raise MiniRunError(f"the evaluation text has {len(ids)} tokens; this run needs {need_text}")
    ctx = max([ppl_tokens, prompt_tokens + positions] + [n + 32 for n in lengths])
    modes = [(None, None)] + [(b, v) for b in budgets for v in kv_values]
    settings = {"model": str(model), "tau": tau, "window": window, "sinks": sinks, "dtype": dtype,
                "key_store": key_store, "centroids": centroids, "far_positions": far_positions,
                "max_select": max_select, "length_scale": length_scale, "rescore": rescore,
                "kv_values": list(kv_values), "ppl_tokens": ppl_tokens,
                "prompt_tokens": prompt_tokens,
                "passkey_haystack": passkey_haystack, "passkey_copies": passkey_copies,
                "positions": positions, "lengths": list(lengths), "depths": list(depths), "trials": trials,
                "threads": torch.get_num_threads() if threads is None else threads}
    rows, ref_logits = [], None
    for budget, values in modes:
        name = mode_name(budget) + ("" if values in (None, "float", "auto") else f" {values} values")
        kw = dict(kv="dense") if budget is None else {**dict(kv="hca", tau=tau, window=window, sinks=sinks,
                                                             key_store=key_store, centroids=centroids,
                                                             far_positions=far_positions, max_select=max_select,
                                                             length_scale=length_scale, rescore=rescore,
                                                             kv_values=values),
                                                      **hca_setting(budget)}
        eng = Engine.load(model, device="cpu", dtype=dtype, ctx=ctx, threads=threads, **kw)
        row: dict = {"mode": name, "seconds": {}}
        cb = getattr(eng.cache.full_layers, "codebooks", None)
        row["codebooks"] = "-" if budget is None else ("exact keys" if eng.cache.full_layers.layout.exact_keys else
                                                       (cb.source if cb else "fitted from the prompt"))
        if ppl_tokens:
            log(f"eval: {name}: perplexity over {ppl_tokens} tokens")
            t0 = time.perf_counter()
            row["ppl"] = perplexity(eng, ids[:ppl_tokens])
            row["seconds"]["ppl"] = round(time.perf_counter() - t0, 1)
        if positions:
            log(f"eval: {name}: teacher forcing, {positions} positions after {prompt_tokens} tokens")
            t0 = time.perf_counter()
            prompt, cont = ids[:prompt_tokens], ids[prompt_tokens:prompt_tokens + positions]
            if budget is None:
                ref_logits = out = teacher_forced_logits(eng, prompt, cont)
            else:
                sel: dict = {}
                out = teacher_forced_logits(eng, prompt, cont, selection=sel)
                row.update(compare_logits(ref_logits, out))
                if "fraction" in sel:
                    row["selected_fraction_by_layer"] = [round(float(x), 4) for x in sel["fraction"].mean(1)]
                    row["selected_fraction_by_head"] = [[round(float(x), 4) for x in r] for r in sel["fraction"]]
                    row["store_tokens"] = [max(0, prompt_tokens - sinks - window),
                                           max(0, prompt_tokens + positions - 1 - sinks - window)]
            row["cont_ppl"] = continuation_ppl(out, cont)
            row["seconds"]["agreement"] = round(time.perf_counter() - t0, 1)
        if lengths:
            log(f"eval: {name}: passkey {list(lengths)} x {list(depths)} x {trials}")
            t0 = time.perf_counter()
            row["passkey"] = passkey(eng, list(lengths), list(depths), trials, seed=seed,
                                     text_ids=ids if passkey_haystack == "text" else None, copies=passkey_copies)
            row["seconds"]["passkey"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        del eng
        gc.collect()
    return {"settings": settings, "rows": rows}


def check_targets(report: dict) -> list[dict]:
    """The HCAttention targets (see TARGETS) against the dense row: one entry per checked item."""
    rows = {r["mode"]: r for r in report["rows"]}
    dense = rows.get("dense")
    out = []
    if dense is None:
        return out
    for budget, (ppl_tol, min_agree, passkey_eq) in TARGETS.items():
        r = rows.get(mode_name(budget))
        if r is None:
            continue
        if ppl_tol is not None and "ppl" in r and "ppl" in dense:
            rel = r["ppl"] / dense["ppl"] - 1
            out.append({"mode": r["mode"], "target": f"ppl within {100 * ppl_tol:g}% of dense",
                        "observed": f"{100 * rel:+.2f}%", "met": rel <= ppl_tol})
        if min_agree is not None and "top1_agreement" in r:
            out.append({"mode": r["mode"], "target": f"top-1 agreement >= {100 * min_agree:g}%",
                        "observed": f"{100 * r['top1_agreement']:.1f}%", "met": r["top1_agreement"] >= min_agree})
        if passkey_eq and "passkey" in r and "passkey" in dense:
            cells = [(d, h) for d, h in zip(dense["passkey"], r["passkey"]) if d["accuracy"] > 0]
            worse = [(d["length"], d["depth"]) for d, h in cells if h["accuracy"] < d["accuracy"]]
            out.append({"mode": r["mode"], "target": "passkey equal to dense wherever dense succeeds",
                        "observed": f"{len(cells) - len(worse)}/{len(cells)} cells" +
                                    (f" (worse at {worse})" if worse else ""), "met": not worse})
    return out


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def format_markdown(report: dict, data: str | None = None) -> str:
    s, rows = report["settings"], report["rows"]
    dense = next((r for r in rows if r["mode"] == "dense"), None)
    lines = []
    if data:
        lines.append(f"data: {data}")
    parts = [f"tau {s['tau']}, window {s['window']}, sinks {s['sinks']}, {s['dtype']}, key store {s['key_store']}"
             + (f", {s['centroids']} centroids" if s.get("centroids") else "")
             + (f", far positions {s['far_positions']}" if s.get("far_positions", "off") != "off" else "")
             + (f", at most {s['max_select']} tokens per head" if s.get("max_select") else "")
             + (f", length scaling {s['length_scale']}" if s.get("length_scale", "off") != "off" else "")
             + (", rescored from host keys" if s.get("rescore") else "")]
    if s.get("ppl_tokens"):
        parts.append(f"ppl over the first {s['ppl_tokens']} tokens")
    if s.get("positions"):
        parts.append(f"agreement over {s['positions']} positions after {s['prompt_tokens']} tokens")
    if s.get("lengths"):
        hay, copies = s.get("passkey_haystack", "filler"), s.get("passkey_copies", 1)
        hay = "" if hay == "filler" else " (in the text" + (f", {copies} copies" if copies > 1 else "") + ")"
        parts.append(f"passkey lengths {s['lengths']} x depths {s['depths']} x {s['trials']} trials{hay}")
    lines += ["settings: " + "; ".join(parts), "",
              "| mode | ppl | vs dense | continuation ppl | top-1 agreement | mean KL (nats) | max KL | passkey (all cells) | codebooks | seconds |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ppl = r.get("ppl")
        rel = f"{100 * (ppl / dense['ppl'] - 1):+.2f}%" if ppl and dense and dense.get("ppl") and r is not dense else "-"
        pk = r.get("passkey") or []
        acc = f"{sum(c['accuracy'] * c['trials'] for c in pk):g}/{sum(c['trials'] for c in pk)}" if pk else "-"
        agree = r.get("top1_agreement")
        secs = ", ".join(f"{k} {v:g}" for k, v in r.get("seconds", {}).items())
        lines.append(f"| {r['mode']} | {_fmt(ppl, '.3f')} | {rel} | {_fmt(r.get('cont_ppl'), '.3f')} | {'-' if agree is None else f'{100 * agree:.1f}%'} | "
                     f"{_fmt(r.get('mean_kl'), '.4f')} | {_fmt(r.get('max_kl'), '.3f')} | {acc} | {r['codebooks']} | {secs} |")
    pk_rows = [r for r in rows if r.get("passkey")]
    if pk_rows:
        lines += ["", "Passkey accuracy per cell (asked length, prompt tokens actually built, depth of the key):", "",
                  "| length | prompt tokens | depth | " + " | ".join(r["mode"] for r in pk_rows) + " |",
                  "|---|---|---|" + "---|" * len(pk_rows)]
        for i, c in enumerate(pk_rows[0]["passkey"]):
            toks = sorted({a["tokens"] for a in c.get("answers", [])})
            toks = "-" if not toks else str(toks[0]) if len(toks) == 1 else f"{toks[0]}-{toks[-1]}"
            lines.append(f"| {c['length']} | {toks} | {c['depth']:g} | " +
                         " | ".join(f"{r['passkey'][i]['accuracy']:.2f}" for r in pk_rows) + " |")
    sel_rows = [r for r in rows if r.get("selected_fraction_by_layer")]
    if sel_rows:
        L = len(sel_rows[0]["selected_fraction_by_layer"])
        st = sel_rows[0]["store_tokens"]
        lo, hi = st if isinstance(st, list) else (st - sel_rows[0]["positions"] + 1, st)
        lines += ["", f"Mean fraction of the store selected per decode step and query head (tau {s['tau']}; "
                      f"the store grows from {lo} to {hi} tokens), by layer:", "",
                  "| layer | " + " | ".join(r["mode"] for r in sel_rows) + " |", "|---|" + "---|" * len(sel_rows)]
        for layer in range(L):
            lines.append(f"| {layer} | " + " | ".join(f"{r['selected_fraction_by_layer'][layer]:.3f}" for r in sel_rows) + " |")
        lines.append("| mean | " + " | ".join(
            f"{sum(r['selected_fraction_by_layer']) / L:.3f}" for r in sel_rows) + " |")
    checks = check_targets(report)
    if checks:
        lines += ["", "| mode | target | observed | met |", "|---|---|---|---|"]
        lines += [f"| {c['mode']} | {c['target']} | {c['observed']} | {'yes' if c['met'] else '**no**'} |" for c in checks]
    return "\n".join(lines)
