"""How much the selections of query heads that share a kv head overlap (what the grouped GPU
gather, kernels_cuda/gather.cu, saves in reads of host memory).

Dense SmolLM2 on the CPU, the first N tokens of Botchan as the prompt, one decode step; per layer
and query head, the exact softmax over the store's keys (after the sinks, older than the ring) and
the minimal set holding tau = 0.9 of its mass, optionally capped at the top C. Printed: the rows
read per head in all, the rows of the union per kv group, and their ratio.

Usage: python scripts/gqa_overlap.py [MODEL] [--tokens 8192] [--window 256] [--sinks 16]
(Botchan: python -c "import sys; sys.path.insert(0, 'scripts'); import eval_quality; eval_quality.fetch_botchan()")
"""
import argparse
from pathlib import Path

import torch

from minirun import Engine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=16)
    ap.add_argument("--tau", type=float, default=0.9)
    a = ap.parse_args()
    N, W, S = a.tokens, a.window, a.sinks
    eng = Engine.load(a.model, device="cpu", ctx=N + 64)
    text = (Path.home() / ".cache/minirun/botchan.txt").read_text()
    ids = eng.tokenize(text)[:N]
    logits, _ = eng.prefill(ids)
    qs = {}
    attend = eng.cache.attend

    def record(layer, q, k, v):
        qs[layer] = q[0].float().clone()
        return attend(layer, q, k, v)
    eng.cache.attend = record
    eng.step(int(logits[-1].argmax()))
    c = eng.cache
    Hq, Hkv = qs[0].shape[0], c.k.shape[1]
    g, scale = Hq // Hkv, qs[0].shape[1] ** -0.5
    for cap in (None, 4096, 1024):
        per_head, union = 0, 0
        for layer, q in qs.items():
            K = c.k[layer, :, S:len(ids) - W + 1].float()            # the store
            for kv in range(Hkv):
                sets = []
                for h in range(kv * g, kv * g + g):
                    p = torch.softmax(K[kv] @ q[h] * scale, 0)
                    order = torch.argsort(p, descending=True)
                    cnt = int((torch.cumsum(p[order], 0) < a.tau).sum()) + 1
                    sets.append(set(order[:min(cnt, cap or cnt)].tolist()))
                per_head += sum(len(s) for s in sets)
                union += len(set().union(*sets))
        print(f"{len(ids)} tokens, cap {cap}: rows read per head {per_head}, union per kv group {union}, "
              f"ratio {per_head / union:.2f}")


if __name__ == "__main__":
    main()
