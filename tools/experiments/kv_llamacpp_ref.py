"""Outside reference for the KV quality table: llama.cpp (llama-cpp-python) perplexity with K/V cache types.

  python tools/experiments/kv_llamacpp_ref.py MODEL f16/f16,q8_0/f16,q8_0/q8_0,f16/q8_0,q4_0/q4_0 [CHUNKS]

Same GGUF, the same tokens (pyllm's tokenizer) and pyllm's protocol (pyllm/perplexity.py: chunks of 512, score the
second half); KL divergence against the first K/V pair. Needs llama-cpp-python; flash attention on (llama.cpp
quantizes V only with it).
"""

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import llama_cpp  # noqa: E402

import pyllm  # noqa: E402
from pyllm.perplexity import chunk_tokens  # noqa: E402

GGML_TYPE = {"f16": 1, "q8_0": 8, "q4_0": 2}
N_CTX, FIRST = 512, 256


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> None:
    model, combos = sys.argv[1], sys.argv[2].split(",")
    n_chunks = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    llm = pyllm.load(model, n_ctx=N_CTX)
    ids, bos = chunk_tokens(llm, Path("/usr/share/common-licenses/GPL-3").read_text(), N_CTX)
    path = str(llm.path)
    base, base_ppl = [], None
    for ci, combo in enumerate(combos):
        tk, tv = combo.split("/")
        L = llama_cpp.Llama(path, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, logits_all=True, type_k=GGML_TYPE[tk],
                            type_v=GGML_TYPE[tv], flash_attn=True, verbose=False)
        nll, kl, top = [], [], 0
        for i in range(n_chunks):
            chunk = ids[i * N_CTX:(i + 1) * N_CTX]
            if bos is not None:
                chunk[0] = bos
            L.reset()
            L.eval(chunk)
            lp = log_softmax(np.array(L.scores[FIRST:N_CTX - 1], dtype=np.float64))
            tgt = np.array(chunk[FIRST + 1:])
            nll += list(-lp[np.arange(len(tgt)), tgt])
            if ci == 0:
                base.append(lp)
            else:
                b = base[i]
                kl += list((np.exp(b) * (b - lp)).sum(-1))
                top += int((b.argmax(-1) == lp.argmax(-1)).sum())
        ppl = math.exp(float(np.mean(nll)))
        base_ppl = base_ppl or ppl
        extra = f" KLD {np.mean(kl):.5f} top1 {100 * top / len(nll):.1f}%" if kl else ""
        print(f"llama.cpp {Path(path).name} K/V {combo}: PPL {ppl:.4f} ({(ppl / base_ppl - 1) * 100:+.2f}%){extra}",
              flush=True)
        del L


if __name__ == "__main__":
    main()
