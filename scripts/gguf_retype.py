"""Rewrite a GGUF with every tensor dequantized to F32, F16 or BF16 (same metadata, same weights).

Usage: python scripts/gguf_retype.py IN.gguf OUT.gguf --type f32|f16|bf16
Used to give llama.cpp the very weights minirun runs (the pulled Q4_1 dequantized), at the same
precision, for the comparison in docs/BENCHMARKS.md. Norm weights stay F32 as llama.cpp expects.
"""
import argparse

import gguf
import numpy as np

from minirun.checkpoint.convert import dequantize_tensor, open_gguf

TYPES = {"f32": (gguf.GGMLQuantizationType.F32, np.float32),
         "f16": (gguf.GGMLQuantizationType.F16, np.float16),
         "bf16": (gguf.GGMLQuantizationType.BF16, None)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", choices=sorted(TYPES), default="f32")
    a = ap.parse_args()
    reader = open_gguf(a.src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(a.dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, field.contents(), vtype)
    qtype, np_type = TYPES[a.type]
    for t in reader.tensors:
        x = dequantize_tensor(t).astype(np.float32)       # [rows, cols] in GGUF order
        if x.ndim == 1 or a.type == "f32":
            w.add_tensor(t.name, x)
        elif a.type == "f16":
            w.add_tensor(t.name, x.astype(np.float16))
        else:
            w.add_tensor(t.name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(a.dst)


if __name__ == "__main__":
    main()
