"""What the checkpoint fixes (`ModelArgs`, read from config.json) and what a run chooses (`EngineConfig`).

Mirrors llama.cpp's hparams/cparams split: the model never reads EngineConfig, the cache never
writes ModelArgs.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from .errors import CheckpointError, MiniRunError



_REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings",   # each >= 1 when given
                  "sliding_window")
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")
_OPTIONAL_POSITIVE_FLOATS = ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcapping")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "qk_norm", "post_norms", "embed_scale")


def _json_kind(v) -> str:
    """How a JSON value reads in a message: 'a string ("576")', 'a list', 'null'."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, str):
        return f"a string ({json.dumps(v)[:40]})"
    kind = {list: "a list", dict: "an object", int: "an integer", float: "a number"}.get(type(v), type(v).__name__)
    return kind if isinstance(v, (list, dict)) else f"{kind} ({v!r})"


def _as_int(name: str, v, low: int) -> int:
    """config.json's integer field `name` (an integral float such as 576.0 is taken), >= low."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise CheckpointError(f"config.json: {name} must be an integer, got {_json_kind(v)}")
    if v < low:
        raise CheckpointError(f"config.json: {name} must be at least {low}, got {v}")
    return v


def check_model_fields(a) -> None:
    """Each ModelArgs field of the type and range the model needs, else one CheckpointError naming it
    (a string "576", a 0 or a negative head count fail here, not as a TypeError deep in the model)."""
    def put(name, v):
        object.__setattr__(a, name, v)
    for name in _REQUIRED_INTS:
        put(name, _as_int(name, getattr(a, name), 1))
    for name in _OPTIONAL_INTS:
        if getattr(a, name) is not None:
            put(name, _as_int(name, getattr(a, name), 1))
    for name in _POSITIVE_FLOATS:
        v = getattr(a, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise CheckpointError(f"config.json: {name} must be a positive number, got {_json_kind(v)}")
        put(name, float(v))
    for name in _OPTIONAL_POSITIVE_FLOATS:
        v = getattr(a, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            raise CheckpointError(f"config.json: {name} must be a positive number or null, got {_json_kind(v)}")
        put(name, None if v is None else float(v))
    if a.hidden_act not in HIDDEN_ACTS:
        raise CheckpointError(f"config.json: hidden_act {a.hidden_act!r} is not supported ({', '.join(HIDDEN_ACTS)})")
    if isinstance(a.norm_offset, bool) or not isinstance(a.norm_offset, (int, float)):
        raise CheckpointError(f"config.json: norm_offset must be a number, got {_json_kind(a.norm_offset)}")
    for name in _BOOLS:
        if not isinstance(getattr(a, name), bool):
            raise CheckpointError(f"config.json: {name} must be true or false, got {_json_kind(getattr(a, name))}")
    if a.rope_scaling is not None and not isinstance(a.rope_scaling, dict):
        raise CheckpointError(f"config.json: rope_scaling must be an object or null, got {_json_kind(a.rope_scaling)}")
    if a.bos_token_id is not None:
        put("bos_token_id", _as_int("bos_token_id", a.bos_token_id, 0))
    eos = a.eos_token_id
    if isinstance(eos, list):
        put("eos_token_id", [_as_int("eos_token_id", e, 0) for e in eos])
    elif eos is not None:
        put("eos_token_id", _as_int("eos_token_id", eos, 0))
    lt = a.layer_types
    if lt is not None and (not isinstance(lt, list) or len(lt) != a.num_hidden_layers
                           or any(t not in ("full_attention", "sliding_attention") for t in lt)):
        raise CheckpointError(f"config.json: layer_types must list full_attention or sliding_attention for each of "
                              f"the {a.num_hidden_layers} layers, got {_json_kind(lt)}")
    if lt is not None:
        put("layer_types", tuple(lt))
    if not isinstance(a.model_type, str):
        raise CheckpointError(f"config.json: model_type must be a string, got {_json_kind(a.model_type)}")


@dataclass(frozen=True)
class ModelArgs:
    """The hyper-parameters of a Llama-family model, as named in Hugging Face config.json (unknown
    keys are dropped; what each architecture's keys mean: minirun/model/arch.py)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int | None = None   # the trained context (None: not stated)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False                        # RMSNorm over each head of q and k before RoPE (qwen3)
    sliding_window: int | None = None            # tokens a sliding layer attends back to (None: no such layer)
    layer_types: tuple | None = None             # per layer "full_attention" | "sliding_attention" (None: all
                                                 # sliding where there is a window)
    rope_local_theta: float | None = None        # the sliding layers' RoPE base (None: rope_theta)
    hidden_act: str = "silu"                     # the MLP's gate: silu | gelu_pytorch_tanh (GELU, tanh form)
    query_pre_attn_scalar: float | None = None   # attention logits scaled by its -1/2 power (None: head_dim's)
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c)
    norm_offset: float = 0.0                     # every norm is (offset + w): the weights stored zero-centred
    post_norms: bool = False                     # norms after the attention and the MLP, before the residual
    embed_scale: bool = False                    # embeddings scaled by sqrt(hidden_size)
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    model_type: str = "llama"
    quantization_config: dict | None = None      # GGUF block formats of the stored weights (minirun/quant)

    def __post_init__(self):
        check_model_fields(self)
        # frozen dataclass: derived defaults go through object.__setattr__
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size < self.num_attention_heads:
                raise CheckpointError(
                    f"config.json: num_attention_heads={self.num_attention_heads} is more than hidden_size="
                    f"{self.hidden_size}, and no head_dim is given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2:
            raise CheckpointError(f"config.json: head_dim={self.head_dim} is odd (rotary embeddings turn pairs)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")

    def layer_window(self, layer: int) -> int | None:
        """The window of tokens `layer` attends over (its own included), or None: the whole context."""
        if self.sliding_window is None:
            return None
        return self.sliding_window if self.layer_types is None or self.layer_types[layer] == "sliding_attention" \
            else None

    @property
    def n_rep(self) -> int:
        """Query heads per kv-head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        if not isinstance(d, dict):
            raise CheckpointError(f"config.json: the top level is {_json_kind(d)}, not an object of settings")
        from .model.arch import config_fields
        d = config_fields(d)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        missing = [n for n in _REQUIRED_INTS if kwargs.get(n) is None]
        if missing:
            raise CheckpointError(f"config.json lacks {', '.join(missing)}")
        return cls(**kwargs)

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelArgs":
        """path: a model directory or a config.json file."""
        path = Path(path)
        cfg = path / "config.json" if path.is_dir() else path
        if not cfg.is_file():
            raise CheckpointError(f"no config.json in {path}" if path.is_dir() else f"no such model: {path}")
        try:
            d = json.loads(cfg.read_bytes().decode("utf-8"))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg} is not valid JSON ({e.msg} at line {e.lineno})") from None
        except UnicodeDecodeError:
            raise CheckpointError(f"{cfg} is not text (not UTF-8): is it a config.json?") from None
        except OSError as e:
            raise CheckpointError(f"cannot read {cfg}: {e.strerror}") from None
        return cls.from_dict(d)


_CTX_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")
MAX_CTX = 1 << 40          # the largest context (and token count of any setting) taken: 1T tokens
EXACT_PREFILL_GPU = 65536  # prefill_mode auto's longest exact prefill on a GPU (EngineConfig.exact_prefill_limit)


def parse_ctx(value: str | int) -> int:
    """'8192' -> 8192, '32K' -> 32768, '4M' -> 4194304, '1.5K' -> 1536 (binary suffixes; read as an
    exact fraction, never through a float, so 99999999999999999999 is itself, and refused)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _CTX_RE.match(str(value))
        if not m:
            raise MiniRunError(f"bad context size {value!r}: use a number with an optional K or M suffix (e.g. 32K, 4M)")
        mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
        n = int(Fraction(m.group(1)) * mult)
    if n < 1:
        raise MiniRunError(f"context size must be positive, got {value!r}")
    if n > MAX_CTX:
        raise MiniRunError(f"context size {value!r} is more than the largest minirun takes, {MAX_CTX} (1024G)")
    return n


KV_BUDGET_PRESETS = (0.5, 0.25, 0.125)
# --weights: as the checkpoint stores them, dequantized to --dtype, or a float checkpoint quantized at load
WEIGHTS = ("stored", "float", "q8_0", "q4_0", "q4_1")


def hca_setting(spec: str | float) -> dict:
    """An HCA key-store setting as the tools name it -> Engine.load keywords: a budget preset
    ("0.125" -> kv_budget=0.125) or explicit codebooks ("g64c16" -> groups=64, centroids=16)."""
    s = str(spec).strip().lower()
    m = re.fullmatch(r"g(\d+)c(\d+)", s)
    if m:
        return {"groups": int(m.group(1)), "centroids": int(m.group(2))}
    try:
        return {"kv_budget": float(s)}
    except ValueError:
        raise MiniRunError(f"bad HCA setting {spec!r}: use a budget (0.5, 0.25, 0.125) or gGcC "
                           f"(e.g. g64c16: 64 groups of 16 centroids)") from None


def hca_setting_name(spec: str | float) -> str:
    """The setting's name in tables: "0.125" -> "0.125", "g64c16" -> "g64c16"."""
    kw = hca_setting(spec)
    return f"{kw['kv_budget']:g}" if "kv_budget" in kw else f"g{kw['groups']}c{kw['centroids']}"


@dataclass
class EngineConfig:
    """Runtime choices: where and how to run, and the KV-cache policy."""

    ctx: int = 8192
    device: str = "auto"              # "cpu" | "cuda" | "auto"
    dtype: str = "float32"            # "float32" | "bfloat16" | "float16": activations, and float weights
    weights: str = "stored"           # WEIGHTS: the weight matrices (minirun/quant)
    kv: str = "dense"                 # "dense" | "hca"
    kv_budget: float | None = 0.25    # HCA preset: 0.5, 0.25, 0.125 (overridden by groups/centroids)
    groups: int | None = None         # HCA: key sub-vectors per head (g)
    centroids: int | None = None      # HCA: centroids per group (c)
    key_store: str = "codebook"       # "codebook" | "exact"
    tau: float = 0.9                  # HCA: softmax mass each query head keeps
    window: int = 256                 # HCA: ring of recent tokens kept exact
    sinks: int = 16                   # HCA: first tokens kept exact
    fit_min_tokens: int = 4096        # HCA without calibrated codebooks: fit once this many keys are stored
    prefill_chunk: int | None = None  # prompt tokens per forward (None: chunk_for picks by device)
    prefill_mode: str = "auto"        # "auto" | "exact" | "anchor" | "hca": how an HCA prompt attends to old tokens
    exact_prefill_max: int | None = None  # auto: exact prefill up to this many prompt tokens (quadratic), anchor
                                      # beyond (None: exact_prefill_limit picks by device and trained context)
    anchor_tokens: int = 2048         # anchor prefill: the first tokens every chunk attends to exactly
    far_positions: str = "auto"       # HCA: "off" | "on" | "grouped" | "auto" (on past the trained ctx): kv/far_positions.py
    far_distance: int | None = None   # that distance D (None: far_positions.default_far_distance)
    max_select: int | None = None     # HCA: at most this many store tokens per head and step (those of highest score)
    head_budgets: str = "auto"        # HCA: "auto" (per-head caps with far positions on: minirun/kv/head_budgets.py) | "off"
    length_scale: str = "off"         # HCA: "off" | "on" | "auto" (on past the trained ctx): logits x log n / log N
    rescore: bool = False             # HCA: exact keys on the host beside the values weight the selected tokens
    kv_values: str = "auto"           # HCA: the store's values on the host: "float" (float16; float32 runs:
                                      # float32), "q8" / "q4" (8 / 4-bit codes per 32 channels: kv/value_codes.py),
                                      # "auto" (q8 on the CPU, float on a GPU: value_codes)
    threads: int | None = None
    parallel: int = 1                 # sequences served at once (minirun serve --parallel), each with a cache of ctx tokens
    cuda_graphs: bool = True          # GPU: decode tokens replayed from CUDA graphs where the cache can be
                                      # captured (dense; HCA with the GPU value sum): minirun/model/cuda_graph.py
    value_sum: str = "auto"           # HCA on a GPU: where the selected values are summed: "gpu" (a kernel
                                      # reads them from the mapped host pool), "host" (Numba), "auto" (gpu
                                      # where the device can read host memory and no rescore asks for host)
    extra: dict = field(default_factory=dict)

    def exact_prefill_limit(self, device_type: str, trained_ctx: int | None) -> int:
        """The longest prompt prefill_mode auto reads exactly: exact_prefill_max when given; else on a
        GPU 64K tokens, and on a CPU the model's trained context (8K when unknown; at most 64K). An
        exact prefill's attention grows with the square of the prompt: on a CPU past a few thousand
        tokens it outweighs the layers' GEMMs (a SmolLM2 token's exact attention at position n is
        ~35K * n FLOP against the GEMMs' 212M, the anchor prefill's ~177M), where a GPU's flash
        attention keeps it small up to 64K."""
        if self.exact_prefill_max is not None:
            return self.exact_prefill_max
        if device_type == "cuda":
            return EXACT_PREFILL_GPU
        return min(trained_ctx or 8192, EXACT_PREFILL_GPU)

    def chunk_for(self, device_type: str) -> int:
        """Prompt tokens per forward: prefill_chunk, or 512 on the CPU and 4096 on a GPU, where a
        chunk's ~600 launches cost more than its arithmetic (a 4M prompt in 1K forwards, not 8K)."""
        return self.prefill_chunk or (4096 if device_type == "cuda" else 512)

    def __post_init__(self):
        self.ctx = parse_ctx(self.ctx)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise MiniRunError(f"unknown dtype {self.dtype!r}: use float32, bfloat16 or float16")
        if self.weights not in WEIGHTS:
            raise MiniRunError(f"unknown weights {self.weights!r}: use {', '.join(WEIGHTS)}")
        if self.device not in ("cpu", "cuda", "auto") and not self.device.startswith("cuda:"):
            raise MiniRunError(f"unknown device {self.device!r}: use cpu, cuda or auto")
        if self.kv not in ("dense", "hca"):
            raise MiniRunError(f"unknown kv policy {self.kv!r}: use dense or hca")
        if self.key_store not in ("codebook", "exact"):
            raise MiniRunError(f"unknown key_store {self.key_store!r}: use codebook or exact")
        if self.prefill_mode not in ("auto", "exact", "anchor", "hca"):
            raise MiniRunError(f"unknown prefill mode {self.prefill_mode!r}: use auto, exact, anchor or hca")
        if self.far_positions not in ("auto", "on", "off", "grouped"):
            raise MiniRunError(f"unknown far_positions {self.far_positions!r}: use auto, on, grouped or off")
        if self.length_scale not in ("auto", "on", "off"):
            raise MiniRunError(f"unknown length_scale {self.length_scale!r}: use auto, on or off")
        if self.head_budgets not in ("auto", "off"):
            raise MiniRunError(f"unknown head_budgets {self.head_budgets!r}: use auto or off")
        if self.kv_values not in ("auto", "float", "q8", "q4"):
            raise MiniRunError(f"unknown kv_values {self.kv_values!r}: use auto, float, q8 or q4")
        if self.value_sum not in ("auto", "gpu", "host"):
            raise MiniRunError(f"unknown value_sum {self.value_sum!r}: use auto, gpu or host")
        for name, (low, high) in _INT_SETTINGS.items():
            _check_setting(name, getattr(self, name), low, high)
        if self.kv_budget is not None and (isinstance(self.kv_budget, bool)
                                           or not isinstance(self.kv_budget, (int, float))):
            raise MiniRunError(f"kv_budget must be a number (0.5, 0.25 or 0.125), got {self.kv_budget!r}")
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not 0.0 < self.tau <= 1.0:
            raise MiniRunError(f"tau must be in (0, 1], got {self.tau!r}")


# settings that only an HCA cache reads, and those only a GPU reads: idle_settings
HCA_ONLY = ("kv_budget", "groups", "centroids", "key_store", "tau", "window", "sinks", "fit_min_tokens",
            "prefill_mode", "exact_prefill_max", "anchor_tokens", "far_positions", "far_distance", "max_select",
            "length_scale", "rescore", "value_sum")
GPU_ONLY = ("value_sum", "cuda_graphs")


def idle_settings(cfg: EngineConfig, given, device_type: str) -> list[tuple[str, str]]:
    """The settings among `given` (names of EngineConfig fields the user set) that change nothing for
    `cfg` on `device_type` ("cpu" | "cuda"): [(name, why)], why as "with --kv dense". A setting left
    at its default is not counted (setting it changes nothing anywhere)."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    exact_keys = cfg.key_store == "exact" or (cfg.groups is None and (cfg.kv_budget or 0.25) >= 0.5)  # (resolve_layout)
    out = []
    for name in given:
        if getattr(cfg, name) == defaults.get(name):
            continue
        if cfg.kv == "dense" and name in HCA_ONLY:
            why = "with --kv dense (it is an HCA cache setting)"
        elif device_type == "cpu" and name in GPU_ONLY:
            why = "on a CPU (it is a GPU setting)"
        elif name in ("rescore", "fit_min_tokens", "groups", "centroids") and exact_keys:
            why = "with exact keys (key_store=exact, or the 0.5 preset): there are no codebooks"
        elif name == "far_distance" and cfg.far_positions == "off":
            why = "with far_positions=off"
        elif name == "exact_prefill_max" and cfg.prefill_mode != "auto":
            why = f"with prefill_mode={cfg.prefill_mode} (only auto reads it)"
        elif name == "anchor_tokens" and cfg.prefill_mode in ("exact", "hca"):
            why = f"with prefill_mode={cfg.prefill_mode} (only anchor prefills read it)"
        else:
            continue
        out.append((name, why))
    return out


# integer settings -> their (least, largest) values (None: unset, where the field allows it): checked
# when an EngineConfig is made, so a bad one fails before any model is loaded (a window of 0 divided
# by zero in the ring; a negative one indexed out of range; threads past a C long overflowed torch)
MAX_THREADS = os.cpu_count() or 1
_INT_SETTINGS = {"window": (1, MAX_CTX), "sinks": (0, MAX_CTX), "fit_min_tokens": (1, MAX_CTX),
                 "exact_prefill_max": (0, MAX_CTX), "anchor_tokens": (0, MAX_CTX), "prefill_chunk": (1, MAX_CTX),
                 "far_distance": (1, MAX_CTX), "max_select": (1, MAX_CTX), "threads": (1, MAX_THREADS),
                 "groups": (1, 1 << 16), "centroids": (2, 32768), "parallel": (1, 256)}
_OPTIONAL_SETTINGS = ("exact_prefill_max", "prefill_chunk", "far_distance", "max_select", "threads", "groups", "centroids")


def _check_setting(name: str, v, low: int, high: int) -> None:
    if v is None and name in _OPTIONAL_SETTINGS:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise MiniRunError(f"{name} must be an integer, got {v!r}")
    if v < low:
        raise MiniRunError(f"{name} must be at least {low}, got {v}")
    if v > high:
        what = " (this machine's CPUs)" if name == "threads" else ""
        raise MiniRunError(f"{name} must be at most {high}{what}, got {v}")
