"""Mean KL divergence from pyllm's float32 reference, for pyllm's fast decode path and for llama.cpp, on the same
GGUF and the same tokens (the protocol of tests/test_fast_accuracy.py: the first N tokens of the GPL-3 text,
teacher-forced one at a time through the decode path).

    python tools/kl_vs_llamacpp.py smollm2 qwen2 -n 200 -n 800
    python tools/kl_vs_llamacpp.py smollm2 qwen2 gemma3 --prompts

--prompts: the last-position KL over tests/heldout_prompts.py (raw text, and chat messages through each model's
template; 3..200 tokens), which is what a user's first sampled token sees.  The prompt lengths cross the fast
path's GEMV / chunked GEMV / GEMM thresholds, so the figures are given per length class, for pyllm's paths:
"prefill" (the default: one forward of the prompt), "gemv" (n_batch 8: every chunk through the int8-activation
GEMV), "decode" (one token at a time through the decode step), "scalar" (prefill with PYLLM_ISA=scalar) and
llama.cpp's default prefill (n_batch 512).

KL(ref || x) per position = sum_v p_ref(v) (log p_ref(v) - log p_x(v)), averaged over positions [0, n).
llama.cpp (llama-cpp-python, installed separately; not a test dependency) evaluates the same ids with
n_ubatch=1, so every position goes through its decode kernels too, with its default f16 KV cache.

--moe: the tiny Qwen3-MoE / Qwen2-MoE checkpoints of tests/test_moe.py (transformers, random weights), converted by
pyllm to each file type; on every position of its prompts: llama.cpp's logits (one batch) against pyllm's float32
reference on the same file (max|diff| / max|logit| per position, top-1 agreement, mean KL) and against transformers'
float32 forward on the checkpoint, and pyllm's fast path against the reference likewise.

    python tools/kl_vs_llamacpp.py --moe qwen3moe qwen2moe --ftype f16 --ftype q8_0 --ftype q4_k_m
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
from test_fast_accuracy import GPL3, decode_logits, heldout_ids  # noqa: E402

LENGTH_CLASSES = ((1, 8, "<=8"), (9, 32, "9-32"), (33, 10**9, ">=33"))


def kl_last(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    pr = torch.log_softmax(ref_logits.double(), -1)
    return (pr.exp() * (pr - torch.log_softmax(logits.double(), -1))).sum().item()


def prompts_mode(key: str, threads: int, pyllm_only: bool) -> None:
    path = str(fixture_path(key))
    fast = pyllm.load(path, n_ctx=512, n_threads=threads)
    prompts = heldout_ids(fast)
    ref = pyllm.load(path, kernels="reference", n_ctx=512)
    refs = [ref.logits(ids)[-1] for ids in prompts]
    del ref
    paths: dict[str, list[float]] = {}

    def prefill(ids):
        return fast.logits(ids)[-1]

    paths["prefill"] = [kl_last(r, prefill(ids)) for r, ids in zip(refs, prompts)]
    g = fast.generator
    n_batch, g.n_batch = g.n_batch, pyllm.ops.GEMV_MAX_M
    paths["gemv"] = [kl_last(r, prefill(ids)) for r, ids in zip(refs, prompts)]
    g.n_batch = n_batch
    paths["decode"] = [kl_last(r, decode_logits(fast, ids)[-1]) for r, ids in zip(refs, prompts)]
    isa = pyllm.ops.get_isa()
    pyllm.ops.set_isa("scalar")
    paths["scalar"] = [kl_last(r, prefill(ids)) for r, ids in zip(refs, prompts)]
    pyllm.ops.set_isa(isa)
    if not pyllm_only:
        from llama_cpp import Llama

        # logits_all: llama-cpp-python's scores then hold every row (without it, the last row is not filled in)
        llm = Llama(path, n_ctx=512, n_threads=threads, verbose=False, logits_all=True)
        out = []
        for r, ids in zip(refs, prompts):
            llm.reset()
            llm.eval(ids)
            out.append(kl_last(r, torch.tensor(np.array(llm.scores[len(ids) - 1]))))
        paths["llama.cpp"] = out
    lens = [len(ids) for ids in prompts]
    print(f"{key}: {len(prompts)} prompts of {min(lens)}..{max(lens)} tokens, isa {isa}, "
          f"last-position KL(float32 reference || x), mean [max] per length class", flush=True)
    for name, kls in paths.items():
        cells = []
        for lo, hi, label in LENGTH_CLASSES + ((1, 10**9, "all"),):
            sel = [k for k, n in zip(kls, lens) if lo <= n <= hi]
            if sel:
                cells.append(f"{label} ({len(sel)}): {np.mean(sel):.2e} [{max(sel):.1e}]")
        print(f"  {name:9s} " + "  ".join(cells), flush=True)


def compare(ref: torch.Tensor, x: torch.Tensor) -> str:
    """All positions of x against ref [n, vocab]: worst max|diff| / max|logit|, top-1 agreement, mean KL."""
    ref, x = ref.double(), x.double()
    rel = ((x - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
    top1 = (x.argmax(-1) == ref.argmax(-1)).double().mean().item()
    pr = torch.log_softmax(ref, -1)
    kl = (pr.exp() * (pr - torch.log_softmax(x, -1))).sum(-1).mean().item()
    return f"rel {rel:.1e}  top-1 {top1:.3f}  KL {kl:.1e}"


# pre-tokenizer names llama.cpp spells differently (llama-vocab.cpp)
LLAMA_CPP_PRE = {"gpt2": "gpt-2"}


def renamed_pre(src: str, pre: str) -> str:
    """A copy of GGUF ``src`` with tokenizer.ggml.pre = ``pre`` (gguf-py copies every other field and tensor)."""
    import gguf

    dst = src + f".pre-{pre}.gguf"
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        value = pre if f.name == "tokenizer.ggml.pre" else f.contents()
        w.add_key_value(f.name, value, f.types[0], sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY
                        else None)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def moe_mode(archs: list[str], ftypes: list[str], threads: int) -> None:
    import test_moe
    from llama_cpp import Llama

    for arch in archs:
        hf = test_moe.hf_model(arch)
        for ftype in ftypes:
            path = str(test_moe.gguf_path(arch, ftype))
            ref = pyllm.load(path, kernels="reference", n_ctx=256, kv_cache="f32")
            fast = pyllm.load(path, n_ctx=256, n_threads=threads)
            try:
                cpp = Llama(path, n_ctx=256, n_threads=threads, logits_all=True, verbose=False)
            except (ValueError, RuntimeError) as e:  # llama-cpp-python's "Failed to load model from file"
                pre = ref.gguf.get("tokenizer.ggml.pre")
                print(f"{arch} {ftype}: llama.cpp does not load pyllm's file ({e}; tokenizer.ggml.pre = {pre!r}); "
                      f"compared on a copy with llama.cpp's pre-tokenizer name (ids are fed as they are)", flush=True)
                cpp = Llama(renamed_pre(path, LLAMA_CPP_PRE.get(pre, pre)), n_ctx=256, n_threads=threads,
                            logits_all=True, verbose=False)
            for prompt in test_moe.PROMPTS:
                ids = ref.tokenize(prompt)
                r = ref.logits(ids)
                cpp.reset()
                cpp.eval(ids)
                theirs = torch.tensor(np.array(cpp.scores[:len(ids)]))
                print(f"{arch} {ftype} {len(ids)} tokens:\n"
                      f"  llama.cpp vs pyllm reference:    {compare(r, theirs)}\n"
                      f"  llama.cpp vs transformers f32:   {compare(test_moe.hf_logits(hf, ids), theirs)}\n"
                      f"  pyllm reference vs transformers: {compare(test_moe.hf_logits(hf, ids), r)}\n"
                      f"  pyllm fast vs pyllm reference:   {compare(r, fast.logits(ids))}", flush=True)
            del cpp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="fixture keys: smollm2, qwen2, gemma3 (with --moe: qwen3moe, qwen2moe)")
    ap.add_argument("-n", type=int, action="append", help="report the mean over the first n positions (repeatable)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--pyllm-only", action="store_true",
                    help="skip llama.cpp (not installed, or A/B of two pyllm builds: run once per PYTHONPATH)")
    ap.add_argument("--prompts", action="store_true",
                    help="last-position KL over the held-out prompts instead of the teacher-forced text")
    ap.add_argument("--moe", action="store_true",
                    help="models are tests/test_moe.py's tiny MoE checkpoints (qwen3moe, qwen2moe), converted by pyllm")
    ap.add_argument("--ftype", action="append", help="with --moe: the file types to convert to (repeatable; "
                    "default q8_0)")
    args = ap.parse_args()
    if args.moe:
        moe_mode(args.models, args.ftype or ["q8_0"], args.threads)
        os._exit(0)
    if args.prompts:
        for key in args.models:
            prompts_mode(key, args.threads, args.pyllm_only)
        os._exit(0)
    ns = sorted(args.n or [200])
    text = Path(GPL3).read_text(encoding="utf-8")

    for key in args.models:
        path = str(fixture_path(key))
        ref = pyllm.load(path, kernels="reference", n_ctx=max(ns) + 16)
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
