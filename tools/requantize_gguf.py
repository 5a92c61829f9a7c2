"""Requantize a GGUF file's 2-D weights to one block type (Q4_0 or Q8_0), keeping its metadata and its 1-D tensors;
or keep its types and cut it to its first N layers.

    python tools/requantize_gguf.py smollm2-135m q4_0 /tmp/SmolLM2-135M-Instruct.Q4_0.gguf
    python tools/requantize_gguf.py smollm2-135m keep /tmp/smollm2-6layers.gguf --layers 6

For speed comparisons on the same model in other block types (SmolLM2 as Q4_1, Q4_0 and Q8_0), and for a real
model small enough to travel to a GPU machine (tools/gpu_check.sh's KL check: its first layers and its output head
are the real weights, so its logits are a real model's next-token distribution in kind, if not in quality).
Weights go through gguf-py both ways (``gguf.quants.dequantize`` then ``gguf.quants.quantize``, llama.cpp's
reference quantizers), so the file is what llama.cpp's own tools would write from these values; requantizing an
already quantized file compounds the rounding, which is fine for speed, not for quality work. Metadata is copied
field by field as gguf-py's own gguf_new_metadata script does; general.file_type is set to the new type.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gguf
import numpy as np

TYPES = {"q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
         "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
         "keep": (None, None)}


def requantize(src: str, kind: str, dst: str, layers: int | None = None) -> None:
    """Writes ``dst`` through ``dst.part``, renamed at the end: the 1-D tensors are copied from ``src``'s memory
    mapping, so writing ``dst`` in place when it is ``src`` would truncate the mapped file under them (SIGBUS),
    and an interrupted run would leave half a file."""
    out = Path(dst)
    if out.is_dir() or (out.exists() and not out.is_file()):  # renaming over /dev/null would replace the device
        raise OSError(f"{dst}: is a directory or not a regular file; give the name of a .gguf file")
    tmp = out.with_name(out.name + ".part")
    try:
        _write(src, kind, str(tmp), layers)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


def _layer(name: str) -> int | None:
    """i of a "blk.i." tensor, else None."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else None


def _write(src: str, kind: str, dst: str, layers: int | None) -> None:
    qtype, ftype = TYPES[kind]
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    n_layer = reader.fields[f"{arch}.block_count"].contents()
    if layers is not None and not 1 <= layers <= n_layer:
        raise ValueError(f"--layers {layers}: the model has {n_layer} layers")
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE and ftype is not None:
            writer.add_file_type(ftype)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == f"{arch}.block_count" and layers is not None else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
    for t in reader.tensors:
        i = _layer(t.name)
        if layers is not None and i is not None and i >= layers:
            continue
        shape = [int(d) for d in reversed(t.shape)]  # gguf-py lists ne0 first; numpy wants rows first
        if block and len(shape) == 2 and shape[-1] % block == 0:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            q = gguf.quants.quantize(w, qtype)
            writer.add_tensor(t.name, q, raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF path or registry name")
    ap.add_argument("type", choices=sorted(TYPES), help="the new block type, or keep: every tensor as it is")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, help="keep only the first N layers (and every tensor outside them)")
    a = ap.parse_args()
    from pyllm.errors import PyllmError
    from pyllm.registry import resolve

    try:
        requantize(str(resolve(a.model)), a.type, a.out, a.layers)
    except (PyllmError, OSError) as e:
        sys.exit(f"requantize_gguf: error: {e}")
    except ValueError as e:  # gguf-py's reader, for a file that is not GGUF
        sys.exit(f"requantize_gguf: error: {a.model}: {e}")
    print(a.out, file=sys.stderr)


if __name__ == "__main__":
    main()
