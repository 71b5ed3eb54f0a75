"""Quality of HCA against dense attention on the same inputs: perplexity, teacher-forced
agreement and KL, passkey retrieval."""
from __future__ import annotations

import random
import re

import torch
import torch.nn.functional as F


def perplexity(eng, ids: list[int], chunk: int = 256) -> float:
    """exp(mean NLL) of ids[1:] given their prefixes; every position through the engine's cache
    policy (HCA at every position when kv="hca")."""
    logits = eng.logits(ids, chunk=chunk)
    nll = F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]), reduction="mean")
    return float(torch.exp(nll))


@torch.inference_mode()
def agreement(ref_eng, eng, prompt: list[int], continuation: list[int]) -> dict:
    """Teacher forcing: both engines read `prompt`, then the true continuation token by token.

    Returns top-1 agreement of the next-token argmax and mean KL(ref || eng) over the
    len(continuation) positions after the prompt.
    """
    ref_eng.reset()
    eng.reset()
    lr, _ = ref_eng.prefill(prompt)
    le, _ = eng.prefill(prompt)
    agree, kls = [], []
    for i, tok in enumerate(continuation):
        pr, pe = F.log_softmax(lr[-1].float(), -1), F.log_softmax(le[-1].float(), -1)
        agree.append(int(pr.argmax() == pe.argmax()))
        kls.append(float(F.kl_div(pe, pr, log_target=True, reduction="sum")))
        if i + 1 < len(continuation):
            lr, le = ref_eng.step(tok), eng.step(tok)
    return {"positions": len(agree), "top1_agreement": sum(agree) / len(agree), "mean_kl": sum(kls) / len(kls)}


FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def passkey_prompt(eng, n_tokens: int, depth: float, key: int) -> list[int]:
    """A chat prompt of about n_tokens: filler with the key sentence at `depth` (0..1), then the question."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = "What is the pass key? Answer with the number only."
    unit = len(eng.tokenize(FILLER, add_bos=False))
    overhead = len(eng.chat_prompt([{"role": "user", "content": needle + question}]))
    reps = max(1, (n_tokens - overhead) // unit)
    before = int(round(reps * depth))
    text = FILLER * before + needle + FILLER * (reps - before) + "\n\n" + question
    return eng.chat_prompt([{"role": "user", "content": text}])


def passkey(eng, lengths: list[int], depths: list[float], trials: int = 1, seed: int = 0) -> list[dict]:
    """Greedy retrieval of a 5-digit key hidden in filler; one row per (length, depth)."""
    rng = random.Random(seed)
    rows = []
    for n in lengths:
        for depth in depths:
            ok = 0
            for _ in range(trials):
                key = rng.randint(10000, 99999)
                ids = passkey_prompt(eng, n, depth, key)
                eng.reset()
                out = eng.generate(ids, max_new_tokens=12).text
                ok += str(key) in re.sub(r"\D", "", out) or str(key) in out
            rows.append({"length": n, "depth": depth, "trials": trials, "accuracy": ok / trials})
    eng.reset()
    return rows
