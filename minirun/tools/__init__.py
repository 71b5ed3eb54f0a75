"""Measuring: `bench.py` (llama-bench's tests, `minirun bench`), `bench_output.py` (its tables),
`evaluate.py` (the quality grid, `minirun eval`) and `calibrate.py` (codebooks and per-head caps,
`minirun calibrate`)."""
