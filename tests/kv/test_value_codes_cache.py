"""The HCA cache with quantized values (kv_values q8 / q4) end to end: the pool holds code rows,
a decode reads them (close to float values' logits), a prompt-cache file of them loads bit-equal
and is smaller, a file of one value type is refused by an engine of another, and the planner's
prompt-cache bytes count them."""
from __future__ import annotations

import pytest
import torch

from minirun import Engine
from minirun.errors import MiniRunError
from minirun.planner import plan_report
from minirun.prompt_cache import PromptCacheMismatch

PROMPT = list(range(5, 205))
NEXT = (3, 77, 150, 9)
HCA = dict(ctx=512, kv="hca", sinks=4, window=46, fit_min_tokens=64)
SETTINGS = {"0.25": dict(kv_budget=0.25, centroids=32), "pairs": dict(groups=4, centroids=16),
            "exact-keys": dict(kv_budget=0.5)}


@pytest.fixture
def model(tiny_model_dir):
    return tiny_model_dir("gqa-untied", hidden_size=128)       # head dim 32: one group of channels


def _continue(eng):
    return torch.stack([eng.step(t).reshape(-1) for t in NEXT])


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_quantized_values_decode_near_float_and_save_smaller(model, tmp_path, setting, kind):
    kw = {**HCA, **SETTINGS[setting]}
    f, q = (Engine.load(model, device="cpu", **kw, kv_values=v) for v in ("float", kind))
    for e in (f, q):
        e.prefill(PROMPT)
    assert q.cache.values.data.dtype == torch.uint8 and q.cache.values.width == {"q8": 34, "q4": 20}[kind]
    lf, lq = _continue(f), _continue(q)
    assert not torch.equal(lf, lq)                                  # the codes are read, not float values
    assert (lf - lq).abs().max().item() < (0.05 if kind == "q8" else 0.3) * lf.abs().max().item()
    # a prompt-cache file of code rows: smaller, and loaded it decodes bit-equal
    for e in (f, q):
        e.rewind(len(PROMPT))
    sf, sq = f.save_prompt_cache(tmp_path / "f.kv"), q.save_prompt_cache(tmp_path / "q.kv")
    values = q.cache.n_store * 2 * 2                                # (L, Hkv) rows
    assert abs((sf - sq) - values * (32 * 4 - {"q8": 34, "q4": 20}[kind])) <= 256   # (headers differ a little)
    b = Engine.load(model, device="cpu", **kw, kv_values=kind)
    assert b.load_prompt_cache(tmp_path / "q.kv", PROMPT) == len(PROMPT)
    assert torch.equal(_continue(b), _continue(q))


def test_a_file_of_another_value_type_is_refused_in_one_line(model, tmp_path):
    kw = {**HCA, **SETTINGS["0.25"]}
    a = Engine.load(model, device="cpu", **kw, kv_values="q4")
    a.prefill(PROMPT)
    a.save_prompt_cache(tmp_path / "q4.kv")
    for other in ("float", "q8"):
        with pytest.raises(PromptCacheMismatch) as e:
            Engine.load(model, device="cpu", **kw, kv_values=other).load_prompt_cache(tmp_path / "q4.kv", PROMPT)
        assert "\n" not in str(e.value) and "values" in str(e.value)


def test_plan_counts_quantized_values(model, tmp_path):
    """The planner's value pool and prompt-cache bytes against a full context's cache and file."""
    ids = torch.randint(4, 300, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    for kind in ("float", "q8", "q4"):
        eng = Engine.load(model, device="cpu", ctx=600, kv="hca", groups=4, centroids=16, window=32, sinks=4,
                          kv_values=kind)
        eng.prefill(ids)
        report = plan_report(eng.args, eng.config, "cpu")
        pool = next(t for t in report["tiers"] if t["tier"] == "value pool")
        assert pool["bytes"] == eng.kv_stats()["host_values_bytes"]
        assert pool["bytes_per_token"] == 2 * 2 * {"float": 128, "q8": 34, "q4": 20}[kind]
        size = eng.save_prompt_cache(tmp_path / "full.kv")
        assert 0 <= size - report["prompt_cache_bytes"] <= 16 * 1024


def test_kv_values_checked():
    from minirun.config import EngineConfig
    with pytest.raises(MiniRunError, match="kv_values"):
        EngineConfig(kv_values="q2")
    with pytest.raises(MiniRunError, match="multiple of 32"):
        from minirun.config import ModelArgs
        from minirun.kv.hca_layout import hca_tier_bytes
        args = ModelArgs.from_dict(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                        model_type="llama"))
        hca_tier_bytes(args, EngineConfig(kv="hca", kv_values="q4"), 1024)


def test_auto_values_are_q8_on_the_cpu(model, tiny_model_dir):
    """kv_values "auto" (the default): q8 codes on the CPU where head_dim is a multiple of 32, float
    where it is not (the tiny models' 16) and on a GPU; the planner counts what the cache holds."""
    from minirun.config import EngineConfig
    from minirun.kv.value_codes import value_codes
    assert EngineConfig().kv_values == "auto"
    assert value_codes("auto", 64, torch.float32, "cpu").kind == "q8"
    assert value_codes("auto", 64, torch.bfloat16, "cuda").kind == "float"
    assert value_codes("auto", 16, torch.float32, "cpu").kind == "float"
    eng = Engine.load(model, device="cpu", **HCA, kv_budget=0.25, centroids=32)
    eng.prefill(PROMPT)
    assert eng.cache.value_codes.kind == "q8" and eng.cache.values.data.dtype == torch.uint8
    q8 = Engine.load(model, device="cpu", **HCA, kv_budget=0.25, centroids=32, kv_values="q8")
    q8.prefill(PROMPT)
    assert torch.equal(_continue(eng), _continue(q8))
    from minirun.kv.hca_layout import hca_tier_bytes
    pool = {cfg.kv_values: hca_tier_bytes(eng.args, cfg, 512)["value pool"]
            for cfg in (eng.config, q8.config, EngineConfig(**{**vars(eng.config), "kv_values": "float"}))}
    assert pool["auto"] == pool["q8"] != pool["float"]
    small = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", **HCA, kv_budget=0.25, centroids=32)
    assert small.cache.value_codes.kind == "float"
