"""CPU kernels (Numba) for the HCAttention KV cache.

Public API (used by the runtime), one module per family; shapes and dtypes are documented on
each function:

* ``weighted_value_sum(z, idx, counts, V, q_to_kv) -> (o, m, l)``: the GPU cache's value sum on
  the host
* ``selected_scores(q, K, idx, counts, q_to_kv, z)``: the selected tokens' exact scores from
  host keys, written over z in place (the ``rescore`` setting; :mod:`kernels_cpu.rescore`)
* ``encode_keys(K, codebooks) -> P``, ``codebook_norms``
* ``hca_decode_attend(...) -> o``: one decode token's whole HCA attention (exact tier, itself,
  the store through LUT, scores, selection and value sum, merged) in one call
  (:mod:`kernels_cpu.hca_step` says how; scratch ``PackedLUT``, its ``lane_map``, ``level_hist``)
* ``hca_exact_decode_attend(...) -> o``: the same for a store of exact keys (the 50% preset:
  :mod:`kernels_cpu.exact_step`)
* :mod:`kernels_cpu.fastscan`: codebooks of 16 centroids, two 4-bit codes per byte;
  ``encode_pairs`` and ``hca_decode_attend_fs``, the decode step for those codes (its levels by
  AVX2 ``pshufb`` lookups, 32 tokens per instruction)
* ``attn_in``, ``attn_out``, ``norm_gemv``: a Llama layer's one-token step around its attention
  (rms_norm, the projections, RoPE, SwiGLU, residuals), float32 or bfloat16 weights (bfloat16
  as uint16 bits; :mod:`kernels_cpu.decode`)
* :mod:`kernels_cpu.quant`: GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) as row
  tiles; ``gemv`` (byte dot products: :mod:`kernels_cpu.quant_intdot`); the tiles are accepted
  by ``attn_in``, ``attn_out`` and ``norm_gemv`` in place of a float matrix;
  :mod:`kernels_cpu.quant_rows`: ``dequantize_rows``, ``dequantize_ids`` (references:
  tests/support/references/quant.py)
* ``dense_attend(q, K, V, n) -> o``: one decode token's exact GQA attention over a dense cache
  (float32 or bfloat16 bits; :mod:`kernels_cpu.dense`)
* ``turn_rows(EK, start, cos, sin) -> out``: rows past `start` turned by one rotation (far positions)
* ``turn_step(q, k, EK, start, cos, sin) -> (q, k, EK)``: a far-position step's query, key and ring turned

Each has a NumPy reference ``<name>_ref`` in tests/support/references/ (with the tests).
float16 key/value pools are accepted; Numba has no CPU float16 type, so they
are viewed as uint16 and converted exactly inside the kernels (hardware
``fpext`` where the target has it, else bit manipulation; see
``HALF_CONVERSION``).
This package imports only numpy and numba.
"""

from ._common import HALF_CONVERSION, set_num_threads, stamp_caches
from .attention import weighted_value_sum
from .decode import attn_in, attn_out, norm_gemv, turn_rows, turn_step
from .dense import dense_attend
from .exact_step import hca_exact_decode_attend
from .hca_step import hca_decode_attend
from .level_select import level_hist
from .packed import PackedLUT, lane_map
from .rescore import selected_scores
from .pq import codebook_norms, encode_keys

from . import quant, quant_rows  # noqa: F401  (quant registers the quantized GEMVs with the decode kernels)
stamp_caches(__name__)           # one cache stamp for every kernel of the package

# Numba's thread pool before any kernel loads from its cache: a cached kernel that holds a parallel
# callee (the fused decode kernels hold the parallel GEMVs) refers to the pool's scheduling
# functions, which are known to the linker only once the pool is launched; loaded first in a
# process, such a kernel crashed (tests/kernels/test_kernels_cpu.py reproduces it in three processes).
import numba as _numba  # noqa: E402
_numba.get_num_threads()

__all__ = ["weighted_value_sum", "selected_scores", "encode_keys", "codebook_norms", "HALF_CONVERSION", "attn_in",
           "attn_out", "norm_gemv", "dense_attend", "turn_rows", "turn_step", "hca_decode_attend", "hca_exact_decode_attend",
           "PackedLUT", "lane_map", "level_hist", "set_num_threads"]
