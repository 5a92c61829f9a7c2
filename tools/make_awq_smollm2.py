"""Build an AWQ SmolLM2-135M-Instruct (for the opt-in slow test and for `pyllm bench`), cached, never committed.

    python tools/make_awq_smollm2.py          # prints the AWQ folder (builds it first if needed)

Steps: the registry's SmolLM2-135M-Instruct GGUF (Q4_1, pulled into the pyllm cache if missing) is dequantized to
float32 by transformers' own GGUF loader (weights, tokenizer and chat template), then auto-round 0.16.1 writes it
round-to-nearest to the AutoAWQ "gemm" format (iters=0, no calibration data) with group size 64, since SmolLM2's
hidden size 576 is not a multiple of 128 (tools/make_awq_fixture.quantize_auto_round). The folder lands in
``<pyllm cache>/fixtures/smollm2-135m-awq-g64-<key>/awq/...``, built once per machine (file lock, temporary folder
renamed into place); ``build.json`` beside it records the build time.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUP_SIZE = 64


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"pyllm_tools_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(HERE.parent))
    from pyllm import registry

    t0 = time.perf_counter()
    gguf = registry.pull("smollm2-135m", quiet=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    t1 = time.perf_counter()
    folder = _tool("make_awq_fixture").quantize_auto_round(model, tok, out / "awq", GROUP_SIZE)
    t2 = time.perf_counter()
    (out / "build.json").write_text(json.dumps({
        "gguf": gguf.name, "writer": "auto-round RTN (iters=0), format auto_awq", "group_size": GROUP_SIZE,
        "folder": str(folder.relative_to(out)), "load_s": round(t1 - t0, 1), "quantize_s": round(t2 - t1, 1),
        "threads": torch.get_num_threads()}, indent=1))


def build_cached() -> Path:
    """The AWQ folder (the one holding config.json), building it first if this machine has none."""
    import auto_round
    import torch
    import transformers

    aw = _tool("autoawq_fixture")
    key = aw.source_key(Path(__file__).read_text(), auto_round.__version__, transformers.__version__,
                        torch.__version__)
    root = aw.cached(f"smollm2-135m-awq-g{GROUP_SIZE}", key, build)
    return root / json.loads((root / "build.json").read_text())["folder"]


def main() -> int:
    t0 = time.perf_counter()
    d = build_cached()
    print(d)
    meta = json.loads(next(p / "build.json" for p in d.parents if (p / "build.json").exists()).read_text())
    print(f"build: {json.dumps(meta)}; this call {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
