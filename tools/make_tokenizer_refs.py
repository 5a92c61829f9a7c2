"""Regenerate tests/data/tokenizer_refs.json: llama.cpp's token ids for the tokenizer test corpus.

llama.cpp is the reference tokenizer for GGUF files. CI does not build it, so its answers are pinned in a small
json that tests/test_tokenizer.py compares against. Run after changing the corpus (needs llama-cpp-python):

    python tools/make_tokenizer_refs.py [--models smollm2,qwen2,gemma3]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "tokenizer_refs.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,qwen2,gemma3")
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import fixture_path  # the same cached fixture files the tests use
    from test_tokenizer import ref_cases

    out = {"llama_cpp_python": llama_cpp.__version__, "models": {}}
    for key in args.models.split(","):
        path = fixture_path(key)
        llm = Llama(model_path=path, vocab_only=True, verbose=False)
        cases = []
        for text, add_special, special in ref_cases(key):
            # llama.cpp's add_bos means "add the special tokens the vocabulary asks for"
            ids = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=special)
            cases.append({"text": text, "add_special": add_special, "special": special, "ids": list(ids)})
        vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        eog = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
        # the bytes each token contributes (with and without special tokens rendered): what streaming relies on
        ids = sorted(set(range(300)) | set(eog) | {i for c in cases for i in c["ids"]} | set(range(n_vocab - 50, n_vocab)))
        buf = ctypes.create_string_buffer(1024)

        def piece(i, special):
            n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, special)
            return buf.raw[:n].hex()

        out["models"][key] = {
            "file": os.path.basename(path),
            "n_vocab": n_vocab,
            "bos": llama_cpp.llama_vocab_bos(vocab),
            "eos": llama_cpp.llama_vocab_eos(vocab),
            "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
            "eog": eog,
            "pieces": [[i, piece(i, True), piece(i, False)] for i in ids],
            "cases": cases,
        }
        print(f"{key}: {len(cases)} cases", file=sys.stderr)
        del llm
    with open(OUT + ".tmp", "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=0)
        f.write("\n")
    os.replace(OUT + ".tmp", OUT)
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
