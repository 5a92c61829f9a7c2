"""`pyllm perplexity MODEL -f TEXT -c 512 [--kv KIND] [--chunks N] [--kl-base f16]` (llama.cpp's protocol).

See pyllm/perplexity.py for the protocol and how each chunk is made to read the KV cache.
"""

from __future__ import annotations

import argparse
import json
import sys

from .common import add_device_arg, add_kernels_arg, add_model_arg, kv_flag, read_text_arg, runtime_info


def add_perplexity_parser(sub) -> None:
    s = sub.add_parser("perplexity", help="perplexity of a text (llama.cpp protocol), KV cache quality",
                       description="Perplexity over chunks of -c tokens, scoring the second half of each chunk "
                                   "(llama.cpp's protocol). With --kl-base, also the mean KL divergence of the "
                                   "--kv cache's token distributions against the base cache's.")
    add_model_arg(s)
    s.add_argument("-f", "--file", required=True, help="text file to score ('-' = standard input)")
    s.add_argument("-c", "--ctx", type=int, default=512, help="tokens per chunk (default 512)")
    s.add_argument("--chunks", type=int, default=None, help="score at most N chunks (default: all)")
    s.add_argument("--kv", default=None, action="append", dest="kv_list", metavar="KIND",
                   help="KV cache type as --kv takes it (f16, q8_0, q4_rot, f16/q4_rot, ...), repeatable to compare "
                        "several in one run (default f16)")
    s.add_argument("--kl-base", default=None, metavar="KIND",
                   help="also compute KL divergence against this cache type (e.g. f16)")
    s.add_argument("--threads", "-t", type=int, default=None, help="CPU threads")
    add_device_arg(s)
    add_kernels_arg(s)
    s.add_argument("--json", action="store_true", help="print one JSON object with the results")
    s.set_defaults(func=cmd_perplexity)


def cmd_perplexity(a) -> int:
    import pyllm

    from .. import perplexity

    kinds = [kv_flag("--kv", k) for k in dict.fromkeys(a.kv_list or ["f16"])]
    if a.kl_base is not None:
        kv_flag("--kl-base", a.kl_base)
    text = read_text_arg(a.file, "-f", limit=perplexity.MAX_TEXT_BYTES, strict=False)
    llm = pyllm.load(a.model, device=a.device, n_ctx=a.ctx, kv_cache="f16", n_threads=a.threads,
                     kernels=a.kernels, quiet=False)
    llm.check_generates()  # an embedding encoder predicts no next token

    def on_chunk(i, n, stats):
        if a.json:
            return
        if i == 0:
            print(f"{n} chunks of {a.ctx} tokens, scoring {a.ctx - 1 - a.ctx // 2} per chunk", file=sys.stderr)
        row = "  ".join(f"{k}: {st.running[-1]:.4f}" for k, st in stats.items())
        print(f"[{i + 1}/{n}] {row}", file=sys.stderr, flush=True)

    stats = perplexity.evaluate(llm, text, n_ctx=a.ctx, kinds=kinds, kl_base=a.kl_base, n_chunks=a.chunks,
                                on_chunk=on_chunk)
    if a.json:
        print(json.dumps({"model": llm.path.name, "ctx": a.ctx, "kl_base": a.kl_base, "runtime": runtime_info(llm),
                          "results": [st.as_dict(bool(a.kl_base)) for st in stats.values()]}))
        return 0
    for kind, st in stats.items():
        line = f"{kind}: Final estimate: PPL = {st.ppl:.4f} +/- {st.ppl_err:.5f}"
        if a.kl_base and kind != a.kl_base:
            line += (f"   mean KLD vs {a.kl_base} = {st.kld_mean:.6f} +/- {st.kld_err:.6f}, "
                     f"same top-1 {100 * st.same_top1 / max(st.count, 1):.2f}%")
        print(line)
    if len(stats) > 1:
        print()
        print(perplexity.format_table(llm.path.name, stats, a.kl_base))
    return 0
