"""Qwen2, Qwen3, Mistral and Gemma 3 through the one layer loop, against transformers on tiny random
checkpoints that transformers itself writes (random biases and norms, so each trait counts):
logits over a prompt in odd chunks, greedy tokens, decode steps (through the CPU's fused kernels)
against one prefill (through torch's ops), a batch of sequences, bfloat16 and Q8_0 steps against
torch's, HCA at tau = 1 against dense, and sliding-window layers past their window."""
import json

import pytest
import torch

from arch_checkpoints import ARCHS, SHAPE, write_arch_checkpoint
from minirun import ContextError, Engine, ModelArgs
from minirun.errors import CheckpointError
from minirun.model import runners
from minirun.model.runners import NumpyTokenRunner
from tests.conftest import TINY_BASE


@pytest.fixture(scope="module")
def arch_dir(tiny_model_dir, tmp_path_factory):
    made = {}

    def make(arch: str, **over):
        key = (arch, repr(sorted(over.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = write_arch_checkpoint(out, arch, tiny_model_dir("gqa-untied"), **over)
        return made[key]
    return make


def _hf(d, arch):
    return ARCHS[arch][1].from_pretrained(str(d), dtype=torch.float32).eval()


def _ids(n=200, seed=1):
    return torch.randint(4, TINY_BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_config_reads_the_architecture(arch_dir, arch):
    a = ModelArgs.from_path(arch_dir(arch))
    gemma = arch == "gemma3_text"
    assert a.model_type == arch and a.sliding_window == (8 if gemma else None)
    assert a.attention_bias == (arch == "qwen2") and a.qk_norm == (arch in ("qwen3", "gemma3_text"))
    assert a.rope_theta == (1e6 if arch in ("qwen2", "gemma3_text") else 10000.0)    # (from rope_parameters)
    assert a.head_dim == (32 if arch == "qwen3" else 16)
    assert (a.post_norms, a.embed_scale, a.norm_offset, a.hidden_act) == \
        ((True, True, 1.0, "gelu_pytorch_tanh") if gemma else (False, False, 0.0, "silu"))
    if gemma:
        assert a.rope_local_theta == 1e4 and a.query_pre_attn_scalar == 24 and a.final_logit_softcapping == 30
        assert [a.layer_window(i) for i in range(3)] == [8, 8, None]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_match_transformers(arch_dir, arch):
    d = arch_dir(arch)
    ids = _ids()
    ours = Engine.load(d, device="cpu", dtype="float32", ctx=512, prefill_chunk=37).logits(ids)
    with torch.no_grad():
        ref = _hf(d, arch)(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape == (200, 300)
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_matches_transformers_generate(arch_dir, arch):
    d = arch_dir(arch)
    ids = _ids(24, seed=2)
    eng = Engine.load(d, device="cpu", ctx=256)
    _assert_fused(eng)
    ours = eng.generate(ids, max_new_tokens=16, ignore_eos=True).tokens
    with torch.no_grad():
        out = _hf(d, arch).generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
    assert ours == out[0, len(ids):].tolist()


def _count_fused_layers(monkeypatch) -> list:
    """Counts the calls of the fused attn_out kernel the CPU's token runner makes (one a layer)."""
    calls = []
    fused = runners.attn_out_into

    def counted(x, *rest):
        calls.append(x.shape[0])
        return fused(x, *rest)
    monkeypatch.setattr(runners, "attn_out_into", counted)
    return calls


def _assert_fused(eng):
    """Every layer and the head of eng's model decode through the CPU's fused kernels."""
    assert isinstance(eng.model.token_runner, NumpyTokenRunner)
    assert all(lw.get("np") is not None for lw in eng.model.w["layers"]) and eng.model.w.get("np") is not None


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_decode_steps_and_a_batch_match_one_prefill(arch_dir, arch, monkeypatch):
    """Token by token through the cache, and two sequences decoding in one batched step, give the
    logits of one prefill of each: the steps through the fused kernels (Gemma's sliding layers past
    their window of 8, with their own RoPE base), the prefill through torch's ops."""
    eng = Engine.load(arch_dir(arch), device="cpu", ctx=128)
    _assert_fused(eng)
    a, b = _ids(40, seed=3), _ids(30, seed=4)
    full_a, full_b = eng.logits(a), eng.logits(b)
    other = eng.sibling()
    eng.prefill(a[:20])
    other.prefill(b[:10])
    calls = _count_fused_layers(monkeypatch)
    for i in range(10):
        la, lb = Engine.step_batch([eng, other], [a[20 + i], b[10 + i]])
        assert torch.allclose(la, full_a[20 + i], atol=1e-4) and torch.allclose(lb, full_b[10 + i], atol=1e-4)
    for t in a[30:]:
        last = eng.step(t)
    assert torch.allclose(last[-1], full_a[-1], atol=1e-4)
    assert calls == [2] * (10 * eng.args.num_hidden_layers) + [1] * (10 * eng.args.num_hidden_layers)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("kw", [dict(dtype="bfloat16"), dict(weights="q8_0")], ids=["bf16", "q8_0"])
def test_fused_decode_steps_equal_the_torch_runners(arch_dir, arch, kw):
    """bfloat16 and Q8_0 decode steps through the fused kernels against the same steps through
    torch's ops (TorchRunner): torch rounds each op's output to bfloat16, the kernels keep float32
    inside a layer's half, so they agree to a few of bfloat16's ulps; Q8_0 to the rounding of the
    activations to 8 bits (the fused GEMVs' byte dot products), ~2e-4 of the logits here."""
    d, ids = arch_dir(arch), _ids(30, seed=7)

    def steps(torch_ops: bool) -> torch.Tensor:
        eng = Engine.load(d, device="cpu", ctx=64, **kw)
        _assert_fused(eng)
        if torch_ops:
            eng.model.use_torch_ops()
        eng.prefill(ids[:20])
        return torch.cat([eng.step(t) for t in ids[20:]])
    fused, ref = steps(False), steps(True)
    tol = 3e-2 if kw.get("dtype") == "bfloat16" else 1e-3
    assert (fused - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_gemma_soft_cap_on_the_fused_steps_matches_transformers(arch_dir):
    """Decode steps through the fused head with a soft-cap of 0.5 (the logits here reach ~0.6, so
    a cap of 30 changes them by ~1e-4 only) against transformers' logits of the whole sequence."""
    d = arch_dir("gemma3_text", final_logit_softcapping=0.5)
    ids = _ids(30, seed=8)
    with torch.no_grad():
        ref = _hf(d, "gemma3_text")(torch.tensor([ids])).logits[0].float()
    eng = Engine.load(d, device="cpu", ctx=64)
    _assert_fused(eng)
    eng.prefill(ids[:20])
    steps = torch.cat([eng.step(t) for t in ids[20:]])
    assert ref.abs().max().item() < 0.5 and (steps - ref[20:]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_hca_at_tau_one_equals_dense(arch_dir, arch):
    """(Gemma's sliding layers keep their 8-token ring beside either cache of its global layer.)"""
    d = arch_dir(arch)
    ids = _ids(160, seed=5)
    dense = Engine.load(d, device="cpu", ctx=256).generate(ids, max_new_tokens=12, ignore_eos=True)
    hca = Engine.load(d, device="cpu", ctx=256, kv="hca", key_store="exact", tau=1.0, window=32, sinks=4)
    assert hca.generate(ids, max_new_tokens=12, ignore_eos=True).tokens == dense.tokens


@pytest.mark.parametrize("arch,over,windows", [
    ("mistral", dict(sliding_window=16), [16, 16]),
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=1), [None, 16]),
    ("gemma3_text", dict(sliding_window=16), [16, 16, None])])
def test_sliding_window_layers_match_transformers_past_the_window(arch_dir, arch, over, windows):
    """A prompt of 70 tokens in chunks of 7 and 10 decode steps (the CPU's fused kernels) past a
    window of 16 (Mistral: every layer; Qwen2 with max_window_layers 1: the second layer only;
    Gemma 3: the first two, with their own RoPE base), dense: the sliding layers through their
    16-token rings."""
    d = arch_dir(arch, **over)
    args = ModelArgs.from_path(d)
    assert [args.layer_window(i) for i in range(args.num_hidden_layers)] == windows
    ids = _ids(80, seed=6)
    eng = Engine.load(d, device="cpu", ctx=128, prefill_chunk=7)
    _assert_fused(eng)
    ours = eng.logits(ids)
    with torch.no_grad():
        ref = _hf(d, arch)(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= 1e-4
    eng.prefill(ids[:70])
    for i, t in enumerate(ids[70:]):
        last = eng.step(t)
        assert torch.allclose(last[-1], ref[70 + i], atol=1e-4)


def test_hca_refuses_a_model_whose_layers_all_slide(arch_dir):
    d = arch_dir("mistral", sliding_window=64)
    with pytest.raises(ContextError, match="every layer of this model attends over a sliding window of 64 tokens"):
        Engine.load(d, device="cpu", ctx=128, kv="hca")
    eng = Engine.load(d, device="cpu", ctx=1024)
    assert type(eng.cache).__name__ == "SlidingWindowCache" and eng.cache.k.shape[2] == 3 * 64   # (not 1024)


def test_qwen_window_applies_only_where_the_config_turns_it_on(tmp_path):
    base = {**SHAPE, "model_type": "qwen2", "sliding_window": 32}
    assert ModelArgs.from_dict({**base, "use_sliding_window": False}).sliding_window is None
    assert ModelArgs.from_dict({**base, "use_sliding_window": True}).sliding_window == 32


def test_an_unknown_architecture_names_the_supported_ones(tmp_path):
    with pytest.raises(CheckpointError, match="model_type='gpt2'.*llama, mistral, qwen2, qwen3"):
        ModelArgs.from_dict({**SHAPE, "model_type": "gpt2"})
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "model_type": "qwen3", "qk_norm": "yes"}))
    with pytest.raises(CheckpointError, match="qk_norm must be true or false"):
        ModelArgs.from_path(tmp_path)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3_text"])
def test_random_checkpoints_of_each_architecture_load_and_run(tmp_path, arch):
    """write_random_checkpoint (scripts/bench_arch.py's models) writes every tensor the
    architecture reads, and Engine.with_random_weights draws them."""
    from minirun.checkpoint.random_checkpoint import write_random_checkpoint
    config = {**SHAPE, "model_type": arch, "head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2}
    d = write_random_checkpoint(config, tmp_path / arch)
    for eng in (Engine.load(d, device="cpu", ctx=32), Engine.with_random_weights(d, device="cpu", ctx=32)):
        assert len(eng.generate(list(range(5, 25)), max_new_tokens=3, ignore_eos=True).tokens) == 3
