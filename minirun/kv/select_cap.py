"""A bound on how many store tokens one query head attends to per step (EngineConfig.max_select).

tau keeps the smallest set of tokens that holds that share of a head's softmax mass; where a
model's attention is diffuse (SmolLM2 past 128K tokens of text: 25-45% of the tokens, GPU run of
docs/BENCHMARKS.md) that set, and the host's value sum over it, grows with the context. The cap
keeps the top `cap` of the set by score, the rest of its mass dropped and the kept part
renormalised by the log-sum-exp merge, as top-k attention does. The selection is a top set by
score already (all tokens at or above a cut), so its top `cap` are the context's top `cap`.
"""
from __future__ import annotations

import numpy as np


def cap_selection(idx: np.ndarray, counts: np.ndarray, scores: np.ndarray, cap: int, compact: bool) -> None:
    """Keep, per head, the `cap` highest-scoring of its selected tokens, in place.

    idx int32 [Hq, >=max(counts)] token indices, counts int32 [Hq]; scores f32: compact [Hq, >=counts]
    (scores[h, t] belongs to idx[h, t], as packed_select returns them; moved along with idx) or
    per token [Hq, >=n] (read at idx). Heads with counts <= cap are untouched; the kept tokens
    come first in no particular order, and counts become min(counts, cap).
    """
    for h in np.nonzero(counts > cap)[0]:
        c = int(counts[h])
        s = scores[h, :c] if compact else scores[h, idx[h, :c]]
        top = np.argpartition(s, c - cap)[c - cap:]          # the cap largest, unordered
        kept = idx[h, top]
        if compact:
            scores[h, :cap] = s[top]
        idx[h, :cap] = kept
        counts[h] = cap
