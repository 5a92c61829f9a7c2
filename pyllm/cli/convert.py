"""``pyllm convert HF_DIR OUT.gguf --type ...``: a Hugging Face checkpoint to a GGUF pyllm (and llama.cpp) can load."""

from __future__ import annotations

import sys


def cmd_convert(a) -> int:
    from ..formats.convert import convert

    log = None if a.quiet else (lambda s: print(s, file=sys.stderr))
    out = convert(a.hf_dir, a.out, a.type, log=log)
    print(out)
    return 0


def add_convert_parser(sub) -> None:
    s = sub.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF",
                       description="Convert a Hugging Face checkpoint directory (config.json, *.safetensors, "
                                   "tokenizer.json) to a GGUF file.")
    s.add_argument("hf_dir", metavar="HF_DIR", help="checkpoint directory")
    s.add_argument("out", metavar="OUT.gguf", help="output file")
    s.add_argument("--type", default="f16", choices=["f32", "f16", "q8_0", "q4_0", "q4_k_m", "mxfp4_moe"],
                   help="weight type (default f16; 1-D tensors stay f32)")
    s.add_argument("--quiet", "-q", action="store_true", help="do not list the tensors")
    s.set_defaults(func=cmd_convert)
