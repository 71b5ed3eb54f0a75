"""minirun/model/cuda_graph.py: decode tokens whose every input lives on the device (what a CUDA graph
captures: GraphedDecode, dense and HCA with the GPU value sum), against the engine's ordinary
decode steps.

On the CPU the captured code runs eagerly (capture=False): the same Model.decode_at and the
caches' attend_at a graph records, so a wrong position, a missing mask or a bucket edge shows here. With a GPU the graphs themselves are
captured and replayed against the eager GPU steps.

Tolerances: float32 1e-4 absolute on logits (the masked attention over a bucket of slots sums in a
different order than the reference's over exactly the live ones); bfloat16 0.05 (as
test_kernels_cuda_layer: a rounding apart); greedy tokens equal.
"""
from __future__ import annotations

import math
import shutil

import pytest
import torch

import kernels_cuda
from minirun import Engine
from minirun.model import cuda_graph, ops

HAVE_GPU = kernels_cuda.available() and torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device / cupy")
emu_only = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (CPU kernel emulator)")
IDS = list(range(5, 26))          # 21 prompt tokens: decoding from position 21 crosses buckets of 8
TOL = {"float32": 1e-4, "bfloat16": 0.05}


def _decode(eng, tokens, step):
    """Prefill IDS, then feed `tokens` one by one through step(token) -> logits [1, V]."""
    eng.reset()
    eng.prefill(IDS)
    return torch.stack([step(t).reshape(-1).float().cpu() for t in tokens])


def _pair(d, dtype, device="cpu", ctx=64):
    """Two engines without graphs of their own: a reference and one to drive through GraphedDecode."""
    ref = Engine.load(d, device=device, dtype=dtype, ctx=ctx, cuda_graphs=False)
    eng = Engine.load(d, device=device, dtype=dtype, ctx=ctx, cuda_graphs=False)
    return ref, eng


@pytest.mark.parametrize("variant", ["gqa-untied", "llama3-rope", "linear-rope-headdim"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_graph_step_matches_engine_step(tiny_model_dir, variant, dtype):
    """The capturable step over buckets of 8 positions (positions 21..40: four buckets, edges
    included) gives the engine's logits; the cache ends where the ordinary steps leave it."""
    ref, eng = _pair(tiny_model_dir(variant), dtype)
    toks = ref.generate(IDS, max_new_tokens=20, ignore_eos=True).tokens
    la = _decode(ref, toks, ref.step)
    gd = cuda_graph.GraphedDecode(eng.model, eng.cache, bucket=8, capture=False)
    lb = _decode(eng, toks, gd.step)
    assert eng.cache.offset == ref.cache.offset == len(IDS) + len(toks)
    assert (la - lb).abs().max().item() <= TOL[dtype]
    assert torch.equal(la.argmax(-1), lb.argmax(-1))
    # what the step wrote at the device position is what the ordinary steps wrote
    n = ref.cache.offset
    assert (ref.cache.k[:, :, :n].float() - eng.cache.k[:, :, :n].float()).abs().max().item() <= TOL[dtype]


def test_eager_graph_step_after_rewind_and_at_capacity(tiny_model_dir):
    """A rewind across a bucket edge, then steps up to the last slot of the cache (n_keys is
    capped at the capacity); a step past it is refused."""
    d = tiny_model_dir("gqa-untied")
    ref, eng = _pair(d, "float32", ctx=40)
    gd = cuda_graph.GraphedDecode(eng.model, eng.cache, bucket=16, capture=False)
    toks = list(range(30, 49))                       # 21 + 19 = 40 tokens: the whole cache
    la = _decode(ref, toks, ref.step)
    lb = _decode(eng, toks[:12], gd.step)            # to position 33 (bucket 32..47)
    eng.rewind(len(IDS) + 5)                         # back to position 26 (bucket 16..31)
    lb2 = torch.stack([gd.step(t).reshape(-1) for t in toks[5:]])
    eng.cache.offset -= 1
    assert eng.cache.graph_key(16) == (("dense", 40), 40) and eng.cache.capacity == 40   # (capped)
    eng.cache.offset += 1
    assert (la[:12] - lb).abs().max().item() <= 1e-4
    assert (la[5:] - lb2).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="capacity"):
        gd.step(1)


@emu_only
@pytest.mark.parametrize("attention", ["sdpa", "kernels"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_graph_step_through_layer_kernels(tiny_model_dir, dtype, attention):
    """The GPU's one-token layer kernels (kernels_cuda.layer, on the emulator) inside the
    capturable step: RoPE from the device position's table (rope_table of rope_cos_sin_at); with
    the GPU's dense attention (kernels_cuda.dense_decode, as on a GPU) RoPE is left to its first
    launch (layer.rope_store), which also writes k, v into the cache."""
    import cuda_emu
    from kernels_cuda.dense_decode import DenseDecodeAttention
    d = tiny_model_dir("gqa-untied")
    ref, eng = _pair(d, dtype)
    assert eng.model.use_cuda_layer_kernels(force=True)
    ref.model.use_torch_ops()
    toks = ref.generate(IDS, max_new_tokens=6, ignore_eos=True).tokens
    la = _decode(ref, toks, ref.step)
    gd = cuda_graph.GraphedDecode(eng.model, eng.cache, bucket=8, capture=False)
    sfx = "f32" if dtype == "float32" else "bf16"
    with cuda_emu.emulated() as be:
        if attention == "kernels":
            a = eng.args
            eng.cache._gpu_attn = DenseDecodeAttention(eng.device, a.num_attention_heads, a.num_key_value_heads,
                                                       a.head_dim, eng.cache.capacity, eng.model.dtype)
        lb = _decode(eng, toks, gd.step)
    names = {x[0] for x in be.launches}
    assert ("rope_store_" + sfx in names) == (attention == "kernels") != ("rope_" + sfx in names)
    assert (la - lb).abs().max().item() <= TOL[dtype]
    assert torch.equal(la.argmax(-1), lb.argmax(-1))
    n = ref.cache.offset
    assert (ref.cache.k[:, :, :n].float() - eng.cache.k[:, :, :n].float()).abs().max().item() <= TOL[dtype]


HCA = dict(kv="hca", kv_budget=0.5, window=8, sinks=4)
HCA_GPU = dict(kv="hca", groups=4, centroids=16, window=8, sinks=4, tau=0.9, prefill_mode="exact", value_sum="gpu",
               cuda_graphs=False)


def _same_steps(la, lb):
    """(steps, vocab) logits of two HCA paths: equal to float rounding at each step, save a rare
    step whose selection flips a token at the tau cut (the two paths split the mass partials
    differently, so a token right at the threshold can fall on either side): that step may differ
    by one such token's share, at most one step in eight."""
    per_step = (la - lb).abs().amax(dim=1)
    assert per_step.max().item() <= 1e-3, per_step
    assert (per_step > 1e-4).sum().item() <= max(1, len(per_step) // 8), per_step


def _gpu_hca_engines(tiny_model_dir, monkeypatch, kw, ctx=128):
    """Two engines with HCACacheCUDA caches (the kernels on the emulator: call inside emulated());
    with length scaling or grouped far positions the model's trained context is 32 tokens, so the
    factor is > 1 and G > 1 here."""
    import cuda_emu
    short = kw.get("length_scale") == "on" or kw.get("far_positions") == "grouped"   # (grouped: G = 6)
    over = {"max_position_embeddings": 32} if short else {}
    if kw.get("kv_values", "float") != "float":
        over["hidden_size"] = 128                                    # (quantized values: head dim 32)
    d = tiny_model_dir("gqa-untied", **over)
    with cuda_emu.hca_cuda_caches():
        return [Engine.load(d, device="cpu", ctx=ctx, **kw) for _ in range(2)]


@emu_only
@pytest.mark.parametrize("kw", [{}, {"far_positions": "on"}, {"max_select": 6}, {"tau": 1.0},
                                {"far_positions": "on", "length_scale": "on"}, {"far_positions": "grouped"},
                                {"kv_values": "q4"},
                                {"kv_values": "q8", "far_positions": "on"}],
                         ids=["tau0.9", "far", "capped", "tau1", "far-length-scaled", "far-grouped", "q4-values",
                              "q8-values-far"])
def test_eager_whole_hca_token_matches_engine_step(tiny_model_dir, monkeypatch, kw):
    """The capturable HCA token (kv/hca_graph.py, run eagerly, kernels on the emulator): the store
    length from device memory with grids for buckets of 16, the eviction on the device (encode,
    store_rows into the pool, the slot) -- the same logits as the ordinary steps, the same store;
    then rewinds inside the ring: the short ring's steps are captured too (its dead slots masked on
    the device, the store not growing until the ring is full again)."""
    import cuda_emu
    prompt = list(range(5, 65))
    with cuda_emu.emulated():
        ref, eng = _gpu_hca_engines(tiny_model_dir, monkeypatch, {**HCA_GPU, **kw})
        gd = cuda_graph.GraphedDecode(eng.model, eng.cache, bucket=16, capture=False)
        ref.prefill(prompt)
        eng.prefill(prompt)
        toks = [int(t) for t in torch.randint(4, 300, (24,), generator=torch.Generator().manual_seed(1))]
        # what a capture's warm-up does before the first replay: run the step, undo its eviction
        with torch.inference_mode():
            key, nk = eng.cache.graph_key(16)
            snap = eng.cache.graph_snapshot()
            eng.cache.graph_prepare()
            gd.io.copy_(torch.tensor([toks[0], eng.cache.offset]))
            gd._run(nk)
            eng.cache.graph_restore(snap)
        la = torch.stack([ref.step(t).reshape(-1) for t in toks])
        lb = torch.stack([gd.step(t).reshape(-1) for t in toks])
        assert gd.eager_steps == 0 and eng.cache.n_store == ref.cache.n_store
        # the store and the ring as the ordinary steps left them (the decoded tokens' k, v differ
        # by float32 rounding: the step's partials are split for a bucket, not for n)
        c, r = eng.cache, ref.cache
        n, n0 = c.n_store, len(prompt) - 4 - 8
        assert torch.equal(c.indices.data[:, :, :n0], r.indices.data[:, :, :n0])
        assert (c.indices.data[:, :, :n] == r.indices.data[:, :, :n]).float().mean() >= 0.95
        dec = c.value_codes.decode                      # (quantized values: the rows as the sums read them)
        for a, b in ((dec(c.values.data[:, :, :n]), dec(r.values.data[:, :, :n])), (c.ek, r.ek), (c.ev, r.ev)):
            assert (a - b).abs().max().item() <= 1e-5
        _same_steps(la, lb)
        # a rewind inside the ring (4 tokens): it is short for 4 steps, which the graph's step runs too
        x0 = eng.cache.offset - 4
        for e in (ref, eng):
            e.rewind(x0)
        assert eng.cache.offset == x0 and eng.cache.n_store == n
        la2 = torch.stack([ref.step(t).reshape(-1) for t in toks[:8]])
        lb2 = torch.stack([gd.step(t).reshape(-1) for t in toks[:8]])
        assert gd.eager_steps == 0 and eng.cache.n_store == ref.cache.n_store == n + 4
        _same_steps(la2, lb2)
        # the last eager position again, after captured steps (the far turn: graphs write it too)
        for e in (ref, eng):
            e.rewind(x0 + 3)
        la3 = torch.stack([ref.step(t).reshape(-1) for t in toks[:4]])
        lb3 = torch.stack([gd.step(t).reshape(-1) for t in toks[:4]])
        assert gd.eager_steps == 0 and eng.cache.n_store == ref.cache.n_store
        _same_steps(la3, lb3)
        m = eng.cache.n_store
        for a, b in ((dec(c.values.data[:, :, :m]), dec(r.values.data[:, :, :m])), (c.ek, r.ek), (c.ev, r.ev)):
            assert (a - b).abs().max().item() <= 1e-5


@emu_only
@pytest.mark.parametrize("kw", [{}, {"far_positions": "on"}], ids=["tau0.9", "far"])
def test_eager_whole_hca_token_through_layer_kernels(tiny_model_dir, monkeypatch, kw):
    """With the GPU's layer kernels the capturable HCA token leaves RoPE to decode_prep
    (rotates_at), which turns q and k as it stages the key: the same logits as the ordinary steps
    (q, k turned by rope_ first), the same exact tier."""
    import cuda_emu
    prompt = list(range(5, 45))
    with cuda_emu.emulated() as be:
        ref, eng = _gpu_hca_engines(tiny_model_dir, monkeypatch, {**HCA_GPU, **kw})
        for e in (ref, eng):
            assert e.model.use_cuda_layer_kernels(force=True)
        assert eng.cache.rotates_at(eng.args.num_attention_heads, eng.model.dtype)
        gd = cuda_graph.GraphedDecode(eng.model, eng.cache, bucket=16, capture=False)
        ref.prefill(prompt)
        eng.prefill(prompt)
        toks = [int(t) for t in torch.randint(4, 300, (10,), generator=torch.Generator().manual_seed(2))]
        la = torch.stack([ref.step(t).reshape(-1) for t in toks])
        n0 = len(be.launches)
        lb = torch.stack([gd.step(t).reshape(-1) for t in toks])
    names = [x[0] for x in be.launches[n0:]]
    assert gd.eager_steps == 0 and "decode_prep_f32" in names and "rope_f32" not in names
    assert (la - lb).abs().max().item() <= 1e-4
    for a, b in ((eng.cache.ek, ref.cache.ek), (eng.cache.ev, ref.cache.ev)):
        assert (a - b).abs().max().item() <= 1e-5


@emu_only
def test_whole_hca_tokens_need_the_gpu_value_sum(tiny_model_dir, monkeypatch):
    """With the host's value sum an HCA token cannot be captured: the engine decodes it eagerly. A
    cap is captured at any tau (the histogram caps on the device)."""
    import cuda_emu
    d = tiny_model_dir("gqa-untied")
    with cuda_emu.emulated():
        eng = _gpu_hca_engines(tiny_model_dir, monkeypatch, HCA_GPU)[0]
        assert cuda_graph.supports(eng.cache)
        with cuda_emu.hca_cuda_caches():
            assert not cuda_graph.supports(Engine.load(d, device="cpu", ctx=128, **{**HCA_GPU, "value_sum": "host"}).cache)
            assert cuda_graph.supports(Engine.load(d, device="cpu", ctx=128,
                                                   **{**HCA_GPU, "tau": 1.0, "max_select": 4}).cache)


def test_rope_at_a_device_position_keeps_its_phase(tiny_model_dir):
    """The angles made from a position tensor (a captured step's) are formed in float64: at 4M
    tokens too they are cos / sin of p * inv_freq rounded once to float32 (in float32 the angle
    itself would be off by up to ~0.25 rad there)."""
    eng = Engine.load(tiny_model_dir("llama3-rope"), device="cpu", ctx=64)
    inv = eng.model.inv_freq64.tolist()
    for p in (0, 7, 4_194_303):
        c, s = ops.rope_cos_sin_at(eng.model.inv_freq64, torch.tensor([p]), torch.float32)
        want_c = torch.tensor([math.cos(p * f) for f in inv], dtype=torch.float32)
        want_s = torch.tensor([math.sin(p * f) for f in inv], dtype=torch.float32)
        assert torch.allclose(c[0], want_c, rtol=0, atol=1e-7) and torch.allclose(s[0], want_s, rtol=0, atol=1e-7)


def test_engine_graphs_on_a_cpu_decode_eagerly(tiny_model_dir, capsys):
    """cuda_graphs (on by default) on a CPU: eager steps, no note; an HCA cache summing values on the
    host cannot be captured whole."""
    d = tiny_model_dir("gqa-untied")
    eng = Engine.load(d, device="cpu", ctx=64, cuda_graphs=True)
    assert eng.graphed is None and eng.cuda_graphs_mode() == "off"
    assert "graph" not in capsys.readouterr().err
    ref = Engine.load(d, device="cpu", ctx=64, cuda_graphs=False)
    assert eng.generate(IDS, max_new_tokens=5, ignore_eos=True).tokens == \
        ref.generate(IDS, max_new_tokens=5, ignore_eos=True).tokens
    assert not cuda_graph.supports(Engine.load(d, device="cpu", ctx=64, kv="hca", kv_budget=0.5).cache)
    with pytest.raises(ValueError, match="captured whole"):
        cuda_graph.GraphedDecode(eng.model, Engine.load(d, device="cpu", ctx=64, kv="hca", kv_budget=0.5).cache)


def test_a_failed_capture_falls_back_to_eager_steps(tiny_model_dir, capsys, monkeypatch):
    """A capture that raises (simulated: no GPU here) prints its cause once; that step and the
    engine's later ones decode eagerly, with the ordinary steps' logits."""
    d = tiny_model_dir("gqa-untied")
    ref = Engine.load(d, device="cpu", ctx=64)
    eng = Engine.load(d, device="cpu", ctx=64)
    g = cuda_graph.GraphedDecode(eng.model, eng.cache, capture=False)
    g.capture = True

    def broken(*a):
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    monkeypatch.setattr(g, "_capture", broken)
    eng.graphed = g
    toks = ref.generate(IDS, max_new_tokens=4, ignore_eos=True).tokens
    la = _decode(ref, toks, ref.step)
    lb = _decode(eng, toks, eng.step)
    assert g.failed == "operation not permitted when stream is capturing" and not g.capture
    assert eng.cuda_graphs_mode() == "off"
    assert capsys.readouterr().err.count("capturing a decode step failed") == 1
    assert (la - lb).abs().max().item() <= 1e-4


def test_cli_generate_with_the_flag(tiny_model_dir):
    from click.testing import CliRunner

    from minirun.cli.main import cli
    r = CliRunner().invoke(cli, ["generate", str(tiny_model_dir("gqa-untied")), "-p", "hello", "-n", "3",
                                 "--device", "cpu", "--hca-opt", "cuda_graphs=false"])
    assert r.exit_code == 0, r.output


@gpu_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_graph_replay_matches_ordinary_steps(tiny_model_dir, dtype):
    """On a GPU: steps replayed from captured graphs (buckets of 8, so several captures and the
    KEEP limit) against the engine's eager steps; a rewind replays an older bucket's graph."""
    ref, eng = _pair(tiny_model_dir("gqa-untied"), dtype, device="cuda")
    toks = ref.generate(IDS, max_new_tokens=20, ignore_eos=True).tokens
    la = _decode(ref, toks, ref.step)
    gd = cuda_graph.GraphedDecode(eng.model, eng.cache, bucket=8)
    assert gd.capture
    lb = _decode(eng, toks, gd.step)
    assert gd.failed is None and gd.captures == 4 and len(gd._graphs) == cuda_graph.KEEP   # n_keys 24, 32, 40, 48
    assert (la - lb).abs().max().item() <= TOL[dtype]
    eng.rewind(len(IDS) + 10)
    lb2 = torch.stack([gd.step(t).reshape(-1).float().cpu() for t in toks[10:]])
    assert (la[10:] - lb2).abs().max().item() <= TOL[dtype]


@gpu_only
def test_gpu_engine_uses_graphs(tiny_model_dir):
    """Engine(cuda_graphs=True) on a GPU decodes through graphs and gives the same greedy tokens
    (float32: the eager steps' unmasked attention kernel differs from the graph's masked one)."""
    d = tiny_model_dir("gqa-untied")
    eng = Engine.load(d, device="cuda", ctx=64, cuda_graphs=True)
    ref = Engine.load(d, device="cuda", ctx=64, cuda_graphs=False)
    a = eng.generate(IDS, max_new_tokens=12, ignore_eos=True).tokens
    assert eng.graphed is not None and eng.graphed.captures >= 1 and eng.graphed.failed is None
    assert eng.cuda_graphs_mode() == "token"
    from minirun.cli.chat import kv_report_line
    assert kv_report_line(eng).endswith("[cuda graphs: token]")
    assert a == ref.generate(IDS, max_new_tokens=12, ignore_eos=True).tokens


@gpu_only
def test_gpu_engine_hca_host_value_sum_decodes_eagerly(tiny_model_dir):
    """With the host's value sum an HCA token cannot be captured: no graphs, the same tokens."""
    d = tiny_model_dir("gqa-untied")
    eng = Engine.load(d, device="cuda", ctx=64, value_sum="host", **HCA)
    ref = Engine.load(d, device="cuda", ctx=64, value_sum="host", cuda_graphs=False, **HCA)
    assert eng.graphed is None and eng.cuda_graphs_mode() == "off"
    assert eng.generate(IDS, max_new_tokens=12, ignore_eos=True).tokens == \
        ref.generate(IDS, max_new_tokens=12, ignore_eos=True).tokens


@gpu_only
@pytest.mark.parametrize("kw", [{}, {"far_positions": "on", "max_select": 6}], ids=["tau0.9", "far-capped"])
def test_gpu_whole_hca_tokens_replayed(tiny_model_dir, monkeypatch, kw):
    """On a GPU, the GPU value sum: whole HCA tokens captured (buckets of 16: several graphs) and
    replayed, against the eager steps of an engine without graphs; the pool rows the graphs wrote
    (store_rows into mapped host memory) against the eager copies; then after a rewind inside the
    ring, whose refilling steps are replayed too."""
    d = tiny_model_dir("gqa-untied")
    kw = {**HCA_GPU, **kw}
    ref = Engine.load(d, device="cuda", ctx=128, **kw)
    eng = Engine.load(d, device="cuda", ctx=128, **kw)
    gd = cuda_graph.GraphedDecode(eng.model, eng.cache, bucket=16)
    prompt = list(range(5, 65))
    ref.prefill(prompt)
    eng.prefill(prompt)
    toks = [int(t) for t in torch.randint(4, 300, (24,), generator=torch.Generator().manual_seed(1))]
    la = torch.stack([ref.step(t).reshape(-1).cpu() for t in toks])
    lb = torch.stack([gd.step(t).reshape(-1).cpu() for t in toks])
    torch.cuda.synchronize()
    assert gd.failed is None and gd.eager_steps == 0 and gd.captures >= 2
    assert (la - lb).abs().max().item() <= 1e-4
    n = eng.cache.n_store
    assert (eng.cache.values.data[:, :, :n] - ref.cache.values.data[:, :, :n]).abs().max().item() <= 1e-5
    # a rewind inside the ring: the short ring's steps replayed too (its dead slots masked)
    for e in (ref, eng):
        e.rewind(e.cache.offset - 5)
    la = torch.stack([ref.step(t).reshape(-1).cpu() for t in toks[:10]])
    lb = torch.stack([gd.step(t).reshape(-1).cpu() for t in toks[:10]])
    torch.cuda.synchronize()
    assert gd.failed is None and gd.eager_steps == 0 and eng.cache.n_store == ref.cache.n_store == n + 5
    assert (la - lb).abs().max().item() <= 1e-4
