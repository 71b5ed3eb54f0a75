"""NumPy references of the runtime's kernels, written for clarity, not speed: the tests compare
each kernel with the function here of the same name plus ``_ref``.

* :mod:`references.cpu`: kernels_cpu's HCA kernels (and kernels_cuda's kernels of the same names)
* :mod:`references.layer`: one decode layer's kernels (kernels_cpu.decode, kernels_cpu.dense) and the
  bfloat16 conversions
* :mod:`references.gpu`: the glue kernels of one kernels_cuda decode step
* :mod:`references.quant`: the GGUF block formats of kernels_cpu.quant and kernels_cuda.quant
* :mod:`references.values`: the HCA store's quantized value rows (minirun/kv/value_codes.py)

All but quant are re-exported here, where every reference is looked up by name (``ref.<name>_ref``).
They import numpy, and from kernels_cpu only the layout constants they share with the kernels
(bucket counts, the quantized tiles' planes), never a kernel.
"""
from .cpu import *  # noqa: F401,F403
from .gpu import *  # noqa: F401,F403
from .layer import *  # noqa: F401,F403
from .values import *  # noqa: F401,F403
