"""The Numba kernels (one module per family); each has a NumPy reference in tests/references/.

All kernels take NumPy arrays and use `cache=True`; fastmath (_common._FASTMATH: reassoc, contract,
vectorized dot products) only in kernels_cpu.decode and the multi-head dots of
kernels_cpu.attention (`_row_dots`, also the exact_step's scoring). Shapes and dtypes are in each
function's docstring.
"""
from ._common import HALF_CONVERSION, set_num_threads  # noqa: F401
from .attention import weighted_value_sum  # noqa: F401
from .decode import attn_in, attn_out, dense_attend, norm_gemv, turn_rows  # noqa: F401
from .exact_step import hca_exact_decode_attend  # noqa: F401
from .hca_step import hca_decode_attend  # noqa: F401
from .level_select import level_hist  # noqa: F401
from .packed import PackedLUT, lane_map  # noqa: F401
from .rescore import selected_scores  # noqa: F401
from .pq import codebook_norms, encode_keys  # noqa: F401

__all__ = [
    "weighted_value_sum",
    "selected_scores",
    "encode_keys",
    "codebook_norms",
    "HALF_CONVERSION",
    "attn_in",
    "attn_out",
    "norm_gemv",
    "dense_attend",
    "turn_rows",
    "hca_decode_attend",
    "hca_exact_decode_attend",
    "PackedLUT",
    "lane_map",
    "level_hist",
    "set_num_threads",
]
