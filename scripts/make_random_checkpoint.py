"""Write a random-weight Llama checkpoint with the shape of any config.json.

Usage: python scripts/make_random_checkpoint.py CONFIG.json OUT_DIR [--dtype bfloat16] [--seed 0] [--no-weights]
Speed and memory figures do not depend on the weights' values, so this stands in for a real model.
"""
import argparse
import json

from minirun.checkpoint.random_checkpoint import write_random_checkpoint

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-weights", action="store_true",
                    help="config and tokenizer only (for Engine.with_random_weights: weights made on the device)")
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = json.load(f)
    print(write_random_checkpoint(cfg, a.out_dir, seed=a.seed, dtype=a.dtype, weights=not a.no_weights))
