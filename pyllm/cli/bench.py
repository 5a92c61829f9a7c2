"""`pyllm bench`: prompt processing (pp) and token generation (tg) speed, in the spirit of llama-bench.

Only model evaluation is timed (no tokenization, no sampling): pp evaluates N prompt tokens in one batch from an
empty cache; tg evaluates N tokens one at a time from an empty cache. With -d D (llama-bench's depth) both start
from a cache already holding D tokens (filled once, untimed; each run truncates back to D), and the test reads
"tg128 @ d2048": the speed of a long chat, where the attention reads the whole cache at every step. Each row
reports mean ± std over -r runs after one warm-up, plus where it stands on the roofline: tg's GB/s (weight bytes +
KV bytes read per token x tok/s) against measured read bandwidth, pp's GFLOP/s against the measured rate of the
prefill GEMM kernel in use (AMX or AVX-512 bf16 where the CPU has them, else the fp32 matmul).
"""

from __future__ import annotations

import argparse
import csv
import gc
import io
import json
import statistics
import sys
import time

from ..errors import KVCacheMemoryError, PyllmError
from .common import (add_device_arg, add_kernels_arg, add_llama_cpp_args, add_lora_args, apply_gpu_layers,
                     kv_kind_from_args, lora_from_args, runtime_info)


def add_bench_parser(sub) -> None:
    s = sub.add_parser(
        "bench", help="measure pp/tg tok/s against the roofline",
        description="Measure prompt processing and token generation speed (llama-bench style).",
        epilog="examples:\n  pyllm bench smollm2-135m\n  pyllm bench model.gguf -p 512 -n 128 -r 5 -o json\n"
               "  pyllm bench --synthetic llama3-8b:q4_k_m -r 2\n"
               "  pyllm bench smollm2-135m -p 0 -n 128 -d 2048 --kv q4_rot   (decode at a 2048-token context)\n"
               "  pyllm bench --probe",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("models", nargs="*", help="GGUF files or registry names")
    s.add_argument("-m", "--model", dest="model_flags", action="append", default=[], metavar="MODEL",
                   help="a model, as llama-bench's -m (repeatable; measured after the MODEL arguments)")
    s.add_argument("--synthetic", action="append", default=[], metavar="SHAPE:TYPE",
                   help="a random-weight model built in memory, e.g. llama3-8b:q4_k_m, llama3-1b:q4_0, "
                        "qwen2.5-7b:q4_k_m, llama3-8b:awq (AWQ int4, group size 128) (repeatable)")
    s.add_argument("--write-gguf", default=None, metavar="PATH",
                   help="write the one --synthetic model as a GGUF file at PATH (for llama.cpp and other runtimes) "
                        "instead of measuring it")
    s.add_argument("--tokenizer-from", default=None, metavar="MODEL",
                   help="with --write-gguf: the model file or registry name whose tokenizer the file gets (default: "
                        "qwen2.5-coder-0.5b for vocabularies of 151936 tokens or more, else smollm2-135m; padded to "
                        "the shape's vocabulary)")
    s.add_argument("-p", "--n-prompt", type=int, default=512,
                   help="prompt tokens for pp, 0..1048576 (0 = skip; default 512)")
    s.add_argument("-n", "--n-gen", type=int, default=128,
                   help="generated tokens for tg, 0..1048576 (0 = skip; default 128)")
    s.add_argument("-d", "--n-depth", type=int, default=0,
                   help="tokens already in the KV cache when each test starts, 0..1048576 (default 0), e.g. -d 2048")
    s.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs per test, 1..1000 (default 5)")
    s.add_argument("-t", "--threads", type=int, default=None, help="threads (default: physical cores)")
    add_device_arg(s)
    s.add_argument("--kv", default="f16", help="KV cache type (default f16), or KEY/VALUE such as f16/q8_0")
    s.add_argument("--kv-k", "-ctk", default=None, metavar="TYPE", help="key cache type (overrides --kv for keys)")
    s.add_argument("--kv-v", "-ctv", default=None, metavar="TYPE", help="value cache type (overrides --kv)")
    add_kernels_arg(s)
    add_llama_cpp_args(s)
    s.add_argument("-o", "--output", default="md", choices=["md", "json", "csv"])
    s.add_argument("--probe", action="store_true",
                   help="(re)measure this machine's bandwidth, fp32 matmul and prefill GEMM rates first")
    s.add_argument("--spec", "-spec", default=None, choices=["lookup", "draft"],
                   help="speculative test instead of pp/tg: greedy chat replies of -n tokens to the shipped grounded, "
                        "open-ended and JSON-schema prompts (pyllm/data/spec_prompts.json), plain and speculative "
                        "interleaved; "
                        "tok/s of each, speedup, acceptance and tokens per verification pass")
    s.add_argument("--spec-k", type=int, default=None, metavar="K", help="most tokens drafted per step (1..7)")
    s.add_argument("--spec-ngram", type=int, default=None, metavar="N", help="longest suffix prompt lookup matches")
    s.add_argument("--draft", default=None, metavar="MODEL", help="draft model for --spec draft")
    add_lora_args(s)
    s.set_defaults(func=cmd_bench)


class Subject:
    """What a bench row measures: a model, its KV cache and a generator, loaded from a file or synthesized."""

    def __init__(self, name, cfg, weights, model, kv, generator, size_bytes, runtime: dict):
        self.name, self.cfg, self.weights, self.model = name, cfg, weights, model
        self.kv, self.gen, self.size_bytes = kv, generator, size_bytes
        self.runtime = runtime  # where it runs: {"device", "backend", "isa" or "gpu"} (common.runtime_info)

    @property
    def n_params(self) -> int:
        n = 0
        for w in self.weights.values():
            m = 1
            for d in w.shape:
                m *= d
            n += m
        return n

    def weight_bytes_per_token(self) -> int:
        """Bytes a decode step reads: every weight once, except the embedding table (one row), unless tied, and a
        mixture of experts' stacked experts (only the selected experts' rows: ModelConfig.active_fraction)."""
        total = 0
        for name, w in self.weights.items():
            if name == "token_embd.weight" and not self.cfg.tied_output:
                total += w.nbytes // w.shape[0]
            else:
                total += int(w.nbytes * self.cfg.active_fraction(name))
        return total

    def matmul_params(self) -> int:
        """Parameters that take part in matmuls per token (all but the embedding lookup; of stacked experts, the
        selected ones)."""
        n = 0
        for name, w in self.weights.items():
            if len(w.shape) == 2 and (name != "token_embd.weight" or self.cfg.tied_output):
                n += w.shape[0] * w.shape[1]
            elif len(w.shape) == 3:
                n += int(w.shape[0] * w.shape[1] * w.shape[2] * self.cfg.active_fraction(name))
        return n

    def output_params(self) -> int:
        """Parameters of the output projection (the embedding matrix where the output is tied to it)."""
        w = self.weights.get("output.weight")
        if w is None and self.cfg.tied_output:
            w = self.weights.get("token_embd.weight")
        return w.shape[0] * w.shape[1] if w is not None and len(w.shape) == 2 else 0


# Tokenizers a written synthetic model takes by default: (registry name, its token count), largest first; the first
# that fits the shape's vocabulary is padded up to it.
SYNTHETIC_TOKENIZERS = (("qwen2.5-coder-0.5b", 151936), ("smollm2-135m", 49152))


def cmd_write_synthetic(a) -> int:
    """--write-gguf: the one --synthetic model written as a GGUF file, one tensor at a time."""
    from ..models.synthetic import synthetic_plan, write_synthetic_gguf
    from ..registry import resolve

    if a.write_gguf is None:
        raise PyllmError("--tokenizer-from goes with --write-gguf PATH")
    if len(a.synthetic) != 1 or a.models:
        raise PyllmError("--write-gguf writes one synthetic model: give exactly one --synthetic SHAPE:TYPE and no "
                         "model files")
    spec = a.synthetic[0]
    cfg, _ = synthetic_plan(spec)
    name = a.tokenizer_from or next((n for n, v in SYNTHETIC_TOKENIZERS if v <= cfg.n_vocab), None)
    if name is None:
        raise PyllmError(f"synthetic {spec} has {cfg.n_vocab} tokens, fewer than any default tokenizer; give "
                         f"--tokenizer-from MODEL")
    tokenizer = resolve(name)
    started, shown = time.perf_counter(), [0]
    tty = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:  # a log (not a terminal) gets a line per GB written
        if tty or done == total or done // 10**9 > shown[0]:
            shown[0] = done // 10**9
            end = "\n" if done == total or not tty else ""
            sys.stderr.write(f"\rpyllm: wrote {done / 1e9:.2f} / {total / 1e9:.2f} GB "
                             f"({time.perf_counter() - started:.0f} s){end}")
            sys.stderr.flush()

    out = write_synthetic_gguf(spec, a.write_gguf, tokenizer, progress)
    print(out)
    return 0


def load_subject(model: str | None, synthetic: str | None, a) -> Subject:
    from .. import backends
    from ..models import build_model
    from ..runtime.generator import Generator

    n_ctx = a.n_depth + max(a.n_prompt, a.n_gen) + 16
    if synthetic:
        from ..models.synthetic import synthetic_model

        if lora_from_args(a):
            raise PyllmError("--lora / --lora-scaled apply to model files: a synthetic model has no adapter to fit")

        from ..backends import split

        device, gpu_layers = split.check_gpu_layers(a.gpu_layers, a.device)
        # a GPU that cannot run says why before 8B of work
        backend = backends.select(device, a.kernels, a.threads, gpu_layers)
        cfg, weights = synthetic_model(synthetic)
        from ..llm_args import plan_kv_cache

        plan_kv_cache(cfg, n_ctx, a.kv)  # as pyllm.load does: a cache too large for memory is refused, not built
        backend = split.place(backend, cfg, weights, device=device, kernels=a.kernels, n_threads=a.threads,
                              gpu_layers=gpu_layers, n_ctx=n_ctx, kv_cache=a.kv, quiet=False)
        mdl = build_model(cfg, weights, backend, max_pos=n_ctx, progress=backend.name in ("cuda", "split"))
        kv = mdl.backend.make_kv_cache(a.kv, cfg.n_layer, cfg.n_kv_head, n_ctx, cfg.head_dim)
        size = sum(w.nbytes for w in weights.values())
        from .. import ops

        rt = dict(backend.describe()) if backend.name in ("cuda", "split") else \
            {"device": "cpu", "backend": a.kernels, "isa": ops.get_isa() if a.kernels == "fast" else None,
             **({"huge_pages": False} if ops.huge_pages_mode() == "never" else {})}
        return Subject(f"synthetic {synthetic}", cfg, weights, mdl, kv, Generator(mdl, kv, n_ctx), size, rt)
    import pyllm

    llm = pyllm.load(model, device=a.device, n_ctx=n_ctx, kv_cache=a.kv, n_threads=a.threads, kernels=a.kernels,
                     quiet=False, lora=lora_from_args(a), gpu_layers=a.gpu_layers)
    llm.check_generates()  # an embedding encoder has no tokens to generate or prompts to score
    p = llm.path
    size = sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else p.stat().st_size  # AWQ folder
    name = p.name + "".join(f" + LoRA {a.path.name} x{a.scale:g}" for a in llm.lora)
    return Subject(name, llm.config, llm.weights, llm.model, llm.kv, llm.generator, size, runtime_info(llm))


def _random_tokens(s: Subject, n: int, seed: int = 0) -> list[int]:
    import torch

    return torch.randint(0, s.cfg.n_vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fill_cache(s: Subject, depth: int) -> None:
    """Puts ``depth`` random tokens in the cache (batches of 512, untimed) for the tests to start from."""
    s.gen.reset()
    toks = _random_tokens(s, depth, seed=1)
    for i in range(0, depth, 512):
        s.gen._forward(toks[i:i + 512])


def time_pp(s: Subject, n: int, depth: int = 0) -> float:
    toks = _random_tokens(s, n)
    s.gen.truncate(depth)
    s.gen.n_batch = n  # one batch, as llama-bench's pp test
    t = time.perf_counter()
    s.gen._forward(toks)
    return time.perf_counter() - t


def time_tg(s: Subject, n: int, depth: int = 0) -> float:
    s.gen.truncate(depth)
    t = time.perf_counter()
    for _ in range(n):
        s.gen._forward([1])
    return time.perf_counter() - t


def run_tests(s: Subject, a, roof: dict, on_row=lambda row: None) -> list[dict]:
    """The pp and tg rows of one model; ``on_row`` gets each as soon as it is measured."""
    rows = []
    cfg = s.cfg
    kv_elem = s.kv.nbytes / (s.kv.max_seq * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 2)
    depth = a.n_depth
    fill_cache(s, depth)
    for test, n in (("pp", a.n_prompt), ("tg", a.n_gen)):
        if n <= 0:
            continue
        fn = time_pp if test == "pp" else time_tg
        fn(s, n, depth)  # warm-up: page faults, first-use allocations, extension load
        samples = [n / fn(s, n, depth) for _ in range(a.repetitions)]
        mean = statistics.fmean(samples)
        std = statistics.stdev(samples) if len(samples) > 1 else 0.0
        row = dict(model_filename=s.name, model_type=f"{cfg.arch} {s.n_params / 1e6:.0f}M",
                   model_size=s.size_bytes, model_n_params=s.n_params, backends=s.runtime["device"],
                   n_threads=a.threads,
                   n_prompt=n if test == "pp" else 0, n_gen=n if test == "tg" else 0, n_depth=depth,
                   test=f"{test}{n}" + (f" @ d{depth}" if depth else ""),
                   avg_ts=mean, stddev_ts=std, samples_ts=samples, kv_type=a.kv, pyllm_backend=a.kernels,
                   isa=s.runtime.get("isa"), gpu=s.runtime.get("gpu"), placement=s.runtime.get("placement"),
                   huge_pages=s.runtime.get("huge_pages", True))
        if test == "tg":
            # the cache grows from depth to depth + n positions: on average depth + n/2 positions of K and V are read
            kv_bytes = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * kv_elem * (depth + n / 2)
            per_tok = s.weight_bytes_per_token() + kv_bytes
            row["bytes_per_token"] = int(per_tok)
            row["gbs"] = per_tok * mean / 1e9
            row["bw_share"] = row["gbs"] / roof["read_gbs"] if roof else None
        else:
            # QK^T and PV over depth + n/2 keys on average
            attn = 2 * 2 * cfg.n_layer * cfg.n_head * cfg.head_dim * (depth + n / 2)
            # a prefill computes logits for its last position only: the output projection once per n tokens
            out = s.output_params()
            flops_tok = 2 * (s.matmul_params() - out) + 2 * out / n + attn
            row["gflops"] = flops_tok * mean / 1e9
            row["prefill_kernel"] = roof.get("prefill_kernel") if roof else None
            row["flops_share"] = row["gflops"] / prefill_peak(roof) if roof else None
        rows.append(row)
        on_row(row)
    return rows


def prefill_peak(roof: dict) -> float:
    """GFLOP/s of the prefill GEMM in use (a roofline cached before it was measured: the fp32 matmul rate)."""
    return roof.get("prefill_gflops") or roof["matmul_gflops"]


def format_md_header(roof: dict) -> str:
    """The roofline line (when one was measured) and the table's head: printed before the first row is measured."""
    out = io.StringIO()
    if roof.get("gpu"):
        out.write(f"roofline ({roof['gpu']}): copy {roof['read_gbs']:.0f} GB/s (read + write), fp16 matmul "
                  f"{roof['matmul_gflops']:.0f} GFLOP/s\n\n")
    elif roof:
        out.write(f"roofline ({roof['cpu']}, {roof['threads']} threads): read {roof['read_gbs']:.1f} GB/s "
                  f"(1 thread {roof['read_gbs_1t']:.1f}), f32 matmul {roof['matmul_gflops']:.0f} GFLOP/s, "
                  f"prefill GEMM ({roof.get('prefill_kernel', 'f32')}) {prefill_peak(roof):.0f} GFLOP/s\n\n")
    out.write("| model | size | params | backend | threads | test | t/s | roofline |\n")
    out.write("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |\n")
    return out.getvalue()


def format_md_row(r: dict) -> str:
    if "gbs" in r:
        share = f"{r['gbs']:.1f} GB/s" + (f" ({100 * r['bw_share']:.0f}% of BW)" if r.get("bw_share") else "")
    else:
        share = f"{r['gflops']:.0f} GFLOP/s" + (f" ({100 * r['flops_share']:.0f}% of peak)"
                                                if r.get("flops_share") else "")
    where = filter(None, (r['pyllm_backend'], r.get('isa'), r.get('gpu'), r.get('placement'),
                          "no huge pages" if r.get("huge_pages") is False else None))
    return (f"| {r['model_filename']} | {r['model_size'] / 2**30:.2f} GiB | {r['model_n_params'] / 1e6:.0f} M "
            f"| {r['backends']} ({', '.join(where)}, "
            f"kv {r['kv_type']}) | {r['n_threads']} | {r['test']} "
            f"| {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} | {share} |\n")


def cmd_bench(a) -> int:
    import torch  # here, not at the top: building the CLI's parser (pyllm --help) must not import torch

    from ..roofline import physical_cores, probe

    a.kv = kv_kind_from_args(a)  # --kv with --kv-k/--kv-v applied: "q8_0", "f16/q4_rot", ...
    a.models = a.models + a.model_flags
    apply_gpu_layers(a)  # -ngl N against --device, before any model loads
    a.threads = a.threads or physical_cores()
    torch.set_num_threads(a.threads)
    if a.kernels == "fast":
        from .. import ops

        ops.set_num_threads(a.threads)
    if not a.models and not a.synthetic:
        if a.probe:
            print(json.dumps(probe(a.threads, force=True), indent=2))
            return 0
        raise PyllmError("give at least one model (or --synthetic SHAPE:TYPE, or --probe)")
    if a.synthetic:
        from ..models.synthetic import check_synthetic_spec

        for spec in a.synthetic:  # a typo in the last one must not wait for every model before it to be measured
            check_synthetic_spec(spec)
    if a.write_gguf is not None or a.tokenizer_from is not None:
        return cmd_write_synthetic(a)
    if a.spec:
        return cmd_bench_spec(a)
    rows = []
    roof = {}  # the roofline of the device the models run on, measured when the first one has loaded
    header_printed = False

    def print_row(row: dict) -> None:  # md: each row as it is measured, as llama-bench prints them
        if a.output == "md":
            sys.stdout.write(format_md_row(row))
            sys.stdout.flush()

    subjects = [(m, None) for m in a.models] + [(None, s) for s in a.synthetic]
    for model, synth in subjects:
        s = None  # the previous model's memory goes before the next one loads (two 8B models may not fit)
        gc.collect()
        try:
            s = load_subject(model, synth, a)
        except KVCacheMemoryError as e:  # bench has no --ctx: its context is what -d/-p/-n ask for
            raise e.with_fix("use a smaller -d, -p or -n (the cache holds depth + max(p, n) + 16 tokens) or a "
                             "smaller --kv type (q8_0, q4_rot, or KEY/VALUE such as q8_0/q4_0)") from None
        on_gpu = s.runtime.get("backend") == "cuda"
        if not roof and (on_gpu or s.runtime["device"] == "cpu"):
            if on_gpu:
                from ..backends import cuda

                roof = cuda.roofline(s.model.backend.device)
            else:
                roof = probe(a.threads, force=a.probe)
        if a.output == "md" and not header_printed:
            sys.stdout.write(format_md_header(roof))
            sys.stdout.flush()
            header_printed = True
        with torch.inference_mode():
            rows += run_tests(s, a, roof if on_gpu or s.runtime["device"] == "cpu" else {}, print_row)
    note = stale_roofline_note(rows, roof)
    if note and roof.get("cpu") and not a.probe:  # a figure cached on a busy machine: measure it again now
        from ..roofline import remeasure_read_bandwidth

        fresh = remeasure_read_bandwidth(roof)
        if fresh is not None:
            for r in rows:
                if r.get("bw_share") is not None:
                    r["bw_share"] = r["gbs"] / fresh["read_gbs"]
            note = (f"pyllm bench: a run read faster than the cached read bandwidth ({roof['read_gbs']:.1f} GB/s) "
                    f"allows; re-measured now: {fresh['read_gbs']:.1f} GB/s, cached for later runs"
                    + (" (the table above used the old figure)" if a.output == "md" else ""))
    if note:
        print(note, file=sys.stderr)
    if a.output == "json":
        print(json.dumps(rows, indent=2))
    elif a.output == "csv":
        buf = io.StringIO()
        keys = [k for k in rows[0] if k != "samples_ts"] if rows else []
        w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        print(buf.getvalue(), end="")
    return 0


STALE_ROOFLINE_SHARE = 1.5  # a GEMV pass reads at most ~1.1x what the probe's one summing loop reads


def stale_roofline_note(rows: list[dict], roof: dict) -> str | None:
    """A warning when a run read weights far faster than the cached roofline says the machine can: the roofline was
    then measured while something else loaded the machine (it is cached per CPU and thread count), and every
    share printed against it is inflated."""
    share = max((r.get("bw_share") or 0.0 for r in rows), default=0.0)
    if share <= STALE_ROOFLINE_SHARE:
        return None
    when = f" on {roof['date']}" if roof.get("date") else ""
    return (f"pyllm bench: a run read {100 * share:.0f}% of the cached read bandwidth "
            f"({roof.get('read_gbs', 0):.1f} GB/s, measured{when}): that figure was probably taken on a busy "
            f"machine; re-measure it on a quiet one with `pyllm bench --probe -t THREADS`")


# ---- speculative decoding test (--spec) ------------------------------------------------------------------------------
def spec_prompts() -> list[dict]:
    from importlib import resources

    return json.loads(resources.files("pyllm").joinpath("data/spec_prompts.json").read_text())["prompts"]


def time_reply(llm, ids: list[int], n: int, spec: str, a, json_schema=None) -> tuple[list[int], float, object]:
    """Greedy reply of up to n tokens from a fresh cache, under ``json_schema`` if given: (tokens, decode seconds,
    SpecStats or None). Decode time starts after the first token (prefill is the same for both modes and not what
    speculation changes)."""
    llm.reset()
    out = list(llm.generate_tokens(ids, max_tokens=n, temperature=0, speculative=spec, spec_k=a.spec_k,
                                   spec_ngram=a.spec_ngram, json_schema=json_schema))
    st = llm.stats
    return out, st.decode_seconds, st.spec


def cmd_bench_spec(a) -> int:
    """Plain vs speculative greedy decoding on each shipped prompt, interleaved (plain, spec, plain, spec, ...) so
    that a busy machine slows both alike; tok/s counts the tokens after the first over the decode time."""
    import pyllm
    from ..runtime.speculative import SpecStats

    if not a.models:
        raise PyllmError("--spec needs a model file or registry name (synthetic models have no tokenizer)")
    if a.spec == "draft" and not a.draft:
        raise PyllmError("--spec draft needs --draft MODEL")
    n = a.n_gen or 128
    rows = []
    for model in a.models:
        llm = pyllm.load(model, device=a.device, n_ctx=2048, kv_cache=a.kv, n_threads=a.threads, kernels=a.kernels,
                         quiet=False, draft=a.draft if a.spec == "draft" else None, lora=lora_from_args(a),
                         gpu_layers=a.gpu_layers)
        for p in spec_prompts():
            ids = llm.chat_ids([{"role": "user", "content": p["prompt"]}])
            schema = p.get("json_schema")
            time_reply(llm, ids, 8, "none", a, schema)  # warm-up
            plain, spec, same, st = [], [], True, None
            for _ in range(a.repetitions):
                ref, t0, _ = time_reply(llm, ids, n, "none", a, schema)
                out, t1, st = time_reply(llm, ids, n, a.spec, a, schema)
                st = st or SpecStats()  # a draft model does not speculate under a grammar
                same &= out == ref
                plain.append((len(ref) - 1) / t0 if t0 else 0.0)
                spec.append((len(out) - 1) / t1 if t1 else 0.0)
            mp, ms = statistics.fmean(plain), statistics.fmean(spec)
            rows.append(dict(model_filename=llm.path.name, prompt=p["name"], kind=p["kind"], spec=a.spec,
                             n_gen=len(ref), kv_type=a.kv, plain_ts=mp, spec_ts=ms, speedup=ms / mp if mp else 0.0,
                             acceptance=st.acceptance, mean_accepted=st.mean_accepted, drafted=st.drafted,
                             plain_steps=st.plain_steps, same_tokens=same))
            if a.output == "md":
                sys.stderr.write(f"pyllm: measured {llm.path.name} {p['name']}\n")
        llm.close()
    if a.output == "json":
        print(json.dumps(rows, indent=2))
        return 0
    print("| model | prompt | kind | tokens | plain t/s | spec t/s | speedup | accepted | tokens/pass | same |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['model_filename']} | {r['prompt']} | {r['kind']} | {r['n_gen']} | {r['plain_ts']:.1f} "
              f"| {r['spec_ts']:.1f} | {r['speedup']:.2f}x | {r['acceptance']:.0%} of {r['drafted']} "
              f"| {r['mean_accepted']:.2f} | {'yes' if r['same_tokens'] else 'NO'} |")
    return 0
