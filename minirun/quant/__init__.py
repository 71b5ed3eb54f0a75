"""GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) kept as they are stored.

- formats: the block formats and their parts (codes, scales), GGUF blocks <-> row-major planes
- matrix: QuantMatrix (linear, embedding, dequantize), RowStack, cat_rows
- checkpoint: config.json's quantization_config, reading quantized weights or quantizing at load
- sizes: stored bytes of a checkpoint's weights (minirun plan, bench)
"""
from .checkpoint import WEIGHTS, matrix_reader, quantization_config, stored_formats
from .formats import FORMATS, BlockFormat, block_format
from .matrix import QuantMatrix, RowStack, cat_rows, is_quantized

__all__ = ["WEIGHTS", "FORMATS", "BlockFormat", "QuantMatrix", "RowStack", "block_format", "cat_rows",
           "is_quantized", "matrix_reader", "quantization_config", "stored_formats"]
