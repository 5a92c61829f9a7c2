"""KL of the fast backend's prefill logits (every position, one batch) from the float32 reference backend, once per
prefill GEMM kernel this CPU runs (f32, avx512-bf16, amx-bf16), on the first N tokens of the GPL-3 text.

    python tools/experiments/prefill_kl.py 128 smollm2-135m qwen2.5-coder-0.5b gemma3-270m
"""
import sys, torch, pyllm
from pyllm import _ext
C = _ext.load()
text = open("/usr/share/common-licenses/GPL-3").read()
def kl(p_logits, q_logits):
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
for name in sys.argv[2:]:
    ref = pyllm.load(name, kernels="reference", n_ctx=n + 8)
    ids = ref.tokenize(text)[:n]
    lr = ref.logits(ids)
    del ref
    fast = pyllm.load(name, n_ctx=n + 8)
    out = {}
    for k in C.prefill_kernels():
        C.set_prefill_kernel(k)
        lf = fast.logits(ids)
        d = kl(lr, lf)
        out[k] = (d.mean().item(), d.max().item(), ((lf - lr).abs().max() / lr.abs().max()).item())
    print(name, n, " ".join(f"{k}: KL mean {a:.2e} max {b:.2e} max|dlogit|/max {c:.2e};" for k, (a, b, c) in out.items()), flush=True)
