"""Our layer loop against transformers.LlamaForCausalLM on the same weights (the golden reference)."""
import pytest
import torch

from minirun import Engine
from tests.conftest import TINY_VARIANTS

transformers = pytest.importorskip("transformers")


def hf_logits(model_dir, ids):
    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float(), model


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_tiny_logits_match_transformers(tiny_model_dir, variant):
    d = tiny_model_dir(variant)
    eng = Engine.load(d, device="cpu", dtype="float32", ctx=512, prefill_chunk=37)  # odd chunk: crosses boundaries
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 300, (200,), generator=g).tolist()
    ours = eng.logits(ids)
    ref, _ = hf_logits(d, ids)
    assert ours.shape == ref.shape == (200, 300)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_tiny_decode_matches_prefill_logits(tiny_model_dir):
    """Token-by-token decode through the cache gives the same last logits as one prefill."""
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=128)
    ids = list(range(4, 60))
    full = eng.logits(ids)
    eng.prefill(ids[:10])
    for t in ids[10:]:
        last = eng.step(t)
    assert torch.allclose(last[-1], full[-1], atol=1e-4)


def test_tiny_greedy_matches_transformers_generate(tiny_model_dir):
    d = tiny_model_dir("gqa-untied")
    eng = Engine.load(d, device="cpu", ctx=256)
    ids = eng.tokenize("The quick brown fox")
    ours = eng.generate(ids, max_new_tokens=20).tokens
    _, model = hf_logits(d, ids)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    ref = out[0, len(ids):].tolist()
    # ours stops at EOS (id 1); compare up to where it stopped
    assert ours == ref[:len(ours)] and len(ours) > 0


def test_smollm2_logits_and_greedy_match_transformers(smollm2_float_dir):
    eng = Engine.load(smollm2_float_dir, device="cpu", dtype="float32", ctx=2048)
    text = ("The history of the city begins with a small settlement on the river. " * 30)
    ids = eng.tokenize(text)[:300]
    assert len(ids) == 300
    ours = eng.logits(ids)
    ref, model = hf_logits(smollm2_float_dir, ids)
    assert (ours - ref).abs().max().item() <= 1e-4
    prompt = eng.chat_prompt([{"role": "user", "content": "Tell me about the Eiffel Tower."}])
    got = eng.generate(prompt, max_new_tokens=64).tokens
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                             eos_token_id=list(eng.tokenizer.eos_ids), pad_token_id=2)
    ref_ids = [t for t in out[0, len(prompt):].tolist() if t not in eng.tokenizer.eos_ids]
    assert got == ref_ids
