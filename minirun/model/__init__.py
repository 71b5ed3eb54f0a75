"""The model: its weights and the one layer loop.

Reading order: `loader.py` (safetensors weights, memory-mapped, fused at load), `ops.py` (each op in
torch, the readable definition), `transformer.py` (`Model.run`: the layer loop over a `Batch` of
sequences, each attending through its own cache), `runners.py` (the per-device halves of a layer,
chosen once at load), `cuda_graph.py` (a decode token captured whole on a GPU).
"""
