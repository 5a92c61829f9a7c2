"""Mean KL divergence from pyllm's float32 reference, for pyllm's fast decode path and for llama.cpp, on the same
GGUF and the same tokens (the protocol of tests/test_fast_accuracy.py: the first N tokens of the GPL-3 text,
teacher-forced one at a time through the decode path).

    python tools/kl_vs_llamacpp.py smollm2 qwen2 -n 200 --n 800

KL(ref || x) per position = sum_v p_ref(v) (log p_ref(v) - log p_x(v)), averaged over positions [0, n).
llama.cpp (llama-cpp-python, installed separately; not a test dependency) evaluates the same ids with
n_ubatch=1, so every position goes through its decode kernels too, with its default f16 KV cache.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import pyllm  # noqa: E402
from conftest import fixture_path  # noqa: E402
from test_fast_accuracy import GPL3, decode_logits  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="fixture keys: smollm2, qwen2, gemma3")
    ap.add_argument("-n", type=int, action="append", help="report the mean over the first n positions (repeatable)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--pyllm-only", action="store_true",
                    help="skip llama.cpp (not installed, or A/B of two pyllm builds: run once per PYTHONPATH)")
    args = ap.parse_args()
    ns = sorted(args.n or [200])
    text = Path(GPL3).read_text(encoding="utf-8")

    for key in args.models:
        path = str(fixture_path(key))
        ref = pyllm.load(path, backend="reference", n_ctx=max(ns) + 16)
        ids = ref.tokenize(text)[:max(ns)]
        pr = torch.log_softmax(ref.logits(ids).double(), -1)

        def kl(logits: torch.Tensor) -> torch.Tensor:
            return (pr.exp() * (pr - torch.log_softmax(logits.double(), -1))).sum(-1)

        fast = pyllm.load(path, n_ctx=max(ns) + 16, n_threads=args.threads)
        k_fast = kl(decode_logits(fast, ids))
        if args.pyllm_only:
            for n in ns:
                print(f"{key}: positions 0..{n}: pyllm fast {k_fast[:n].mean().item():.3e} "
                      f"(isa {pyllm.ops.get_isa()}, pyllm from {Path(pyllm.__file__).parent})", flush=True)
            continue
        from llama_cpp import Llama

        llm = Llama(path, n_ctx=max(ns) + 16, n_threads=args.threads, logits_all=True, verbose=False,
                    n_batch=512, n_ubatch=1)
        llm.eval(ids)
        k_cpp = kl(torch.tensor(np.array(llm.scores[:len(ids)]), dtype=torch.float64))
        for n in ns:
            a, b = k_fast[:n].mean().item(), k_cpp[:n].mean().item()
            print(f"{key}: positions 0..{n}: pyllm fast {a:.3e}  llama.cpp {b:.3e}  ratio {a / b:.2f}", flush=True)
    os._exit(0)  # llama-cpp-python's destructor can raise at interpreter exit


if __name__ == "__main__":
    main()
