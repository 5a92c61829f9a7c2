"""AWQ fixtures written by AutoAWQ 0.2.9 itself (the writer behind most hub "-AWQ" repos), for the AWQ tests.

AutoAWQ needs transformers 4.51.3 while pyllm's tests run on transformers 5, so it lives in its own venv:

    python tools/autoawq_fixture.py venv            # build (once per machine) and print its python
    python tools/autoawq_fixture.py write OUT_DIR   # build the venv if needed, then write the fixtures below
    python tools/autoawq_fixture.py cached          # the same, once per machine, under <pyllm cache>/fixtures

The venv (``<pyllm cache>/venvs/autoawq-0.2.9``, see ``pyllm.registry.cache_dir``) is made with
``--system-site-packages`` so it reuses the main environment's torch; pip installs ``autoawq==0.2.9 --no-deps``
(its triton requirement is skipped on purpose: CPU only) and then transformers 4.51.3 and AutoAWQ's other runtime
imports, with torch pinned to the main environment's version so pip never replaces it. It is built in a temporary
folder beside the final one under a file lock and renamed into place when complete, so an interrupted build
leaves nothing half-made and concurrent test runs build it once.

What ``write`` puts under OUT_DIR (run inside the venv; nothing is downloaded, ~10 s on 2 cores):
- ``layers.safetensors``: for each (G, K, N) in LAYER_SPECS a random fp16 ``nn.Linear`` quantized with AutoAWQ's
  ``AwqQuantizer.pseudo_quantize_tensor`` and packed by ``WQLinear_GEMM.from_linear`` (``<id>.qweight``,
  ``<id>.qzeros``, ``<id>.scales``), beside ``awq.utils.packing_utils.dequantize_gemm``'s output on them in fp16
  (``<id>.ref_f16``) and with the scales cast to fp32 (``<id>.ref_f32``); ``<id>`` is ``g{G}_k{K}_n{N}``.
- ``<name>/`` for each MODEL_SPECS entry: a tiny random model built by transformers 4.51.3, saved in
  ``dense_dtype`` (``<name>.dense/``), loaded by ``AutoAWQForCausalLM.from_pretrained`` (``load_dtype``; "auto"
  is AutoAWQ's default, the checkpoint's own dtype), quantized by AutoAWQ's AWQ search on the CPU
  (``model.quantize(..., apply_clip=False)``, calibration given as token-id lists) and written by
  ``save_quantized``, plus the tokenizer: the folder is exactly what AutoAWQ writes.
  ``<name>.ref.safetensors`` is the logits reference: the quantized model's parameters in fp32, with every
  ``WQLinear_GEMM`` replaced by ``dequantize_gemm`` of its buffers (fp32 scales) as a dense ``weight``.

AutoAWQ's scale search is broken on the CPU: ``_compute_best_scale`` snapshots the block with
``{k: v.cpu() for k, v in state_dict().items()}``, which on the CPU returns the same tensors, and then scales the
weights in place (``fc.weight.mul_``), so every "restore" reloads already-scaled weights and the search ends with
corrupted weights. ``ClonedSnapshotQuantizer`` below is AwqQuantizer with only that snapshot taken as clones; it
checks after each search that the block's weights are back as they were (the stock quantizer fails that check).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_NAME = "autoawq-0.2.9"
AUTOAWQ = "autoawq==0.2.9"
DEPS = ["transformers==4.51.3", "accelerate", "datasets==3.6.0", "safetensors", "tokenizers", "huggingface_hub",
        "zstandard"]
STAMP = ".pyllm-venv.json"
PIP_NET = ["--timeout", "30", "--retries", "1", "--disable-pip-version-check", "-q"]

# (group size, K = in_features, N = out_features): K % G == 0, and N % 32 == 0 because WQLinear_GEMM.from_linear
# sizes qweight as N // 32 * 4 words (N = 8 or 40 gives an IndexError or a truncated qweight in AutoAWQ 0.2.9)
LAYER_SPECS = [(32, 64, 32), (32, 128, 96), (32, 96, 64),
               (64, 576, 64), (64, 128, 192), (64, 320, 32),
               (128, 128, 128), (128, 384, 96), (128, 1024, 32)]
# name -> dense model settings. llama: hidden 192 (not a multiple of 128), tied embeddings (no lm_head saved),
# loaded in fp16 (what AutoAWQ's docs pass; all non-quantized tensors fp16); qwen2: q/k/v biases, separate lm_head,
# a bf16 checkpoint loaded with AutoAWQ's default torch_dtype="auto" (bf16 embeddings/norms beside fp16 scales)
MODEL_SPECS = {
    "llama-g64": dict(arch="llama", group_size=64, tied=True, hidden=192, intermediate=384, seed=64,
                      dense_dtype="float32", load_dtype="float16"),
    "qwen2-g128": dict(arch="qwen2", group_size=128, tied=False, hidden=128, intermediate=256, seed=128,
                       dense_dtype="bfloat16", load_dtype="auto"),
}


class VenvUnavailable(RuntimeError):
    """The AutoAWQ venv could not be built (no network, no wheel): the tests that need it skip with this reason."""


# ---------------------------------------------------------------------------------------------------- main env side
def venv_dir() -> Path:
    sys.path.insert(0, str(HERE.parent))
    from pyllm.registry import cache_dir

    return cache_dir() / "venvs" / VENV_NAME


def _spec() -> dict:
    import torch

    return {"autoawq": AUTOAWQ, "deps": DEPS, "torch": torch.__version__.split("+")[0],
            "base_python": os.path.realpath(sys.executable)}


def _venv_python(d: Path) -> Path:
    return d / "bin" / "python"


def _pip(py: Path, args: list[str], log) -> None:
    cmd = [str(py), "-m", "pip", "install", *PIP_NET, *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    log.write(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}\n")
    if r.returncode != 0:
        errs = [ln for ln in r.stderr.splitlines() if ln.startswith("ERROR")] or r.stderr.strip().splitlines() or [""]
        raise VenvUnavailable(f"pip install {' '.join(args)} failed (exit {r.returncode}): {errs[-1][:300]}")


def ensure_venv(quiet: bool = True) -> Path:
    """The AutoAWQ venv's python, building the venv first if it is missing or stale. Raises VenvUnavailable."""
    from pyllm.registry import _locked

    final = venv_dir()
    spec = _spec()

    def ready() -> bool:
        try:
            return json.loads((final / STAMP).read_text()) == spec and _venv_python(final).exists()
        except (OSError, ValueError):
            return False

    if ready():
        return _venv_python(final)
    with _locked(final.parent / f"{VENV_NAME}.lock"):
        if ready():  # another process built it while we waited
            return _venv_python(final)
        tmp = final.parent / f".{VENV_NAME}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.perf_counter()
        if not quiet:
            print(f"building {final} (AutoAWQ 0.2.9 + transformers 4.51.3, ~1 min)...", file=sys.stderr)
        try:
            r = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(tmp)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise VenvUnavailable(f"python -m venv failed: {(r.stderr.strip().splitlines() or [''])[-1]}")
            py = _venv_python(tmp)
            with open(tmp / "build.log", "w") as log:
                _pip(py, ["--no-deps", AUTOAWQ], log)
                _pip(py, [*DEPS, f"torch=={spec['torch']}"], log)
            check = subprocess.run([str(py), "-c", "import awq, torch, transformers; "
                                    "print(transformers.__version__, torch.__version__)"],
                                   capture_output=True, text=True, env=_env())
            if check.returncode != 0 or not check.stdout.startswith("4.51.3 " + spec["torch"]):
                raise VenvUnavailable(f"the AutoAWQ venv does not import: {check.stdout.strip()} "
                                      f"{(check.stderr.strip().splitlines() or [''])[-1]}")
            (tmp / STAMP).write_text(json.dumps(spec))
            if final.exists():  # stale (other spec): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)  # a venv run as `python -m ...` survives the move (paths come from pyvenv.cfg)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not quiet:
            print(f"built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return _venv_python(final)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", TQDM_DISABLE="1")
    return env


def write(out: Path, what: str = "all", quiet: bool = True) -> Path:
    """Build the venv if needed and run this file's writer in it; returns ``out``. Raises VenvUnavailable or
    RuntimeError (the writer failed: its last lines of output in the message)."""
    py = ensure_venv(quiet=quiet)
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([str(py), str(Path(__file__).resolve()), "_in_venv", str(out), what],
                       capture_output=True, text=True, env=_env())
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"the AutoAWQ writer failed (exit {r.returncode}):\n{tail}")
    if not quiet:
        sys.stderr.write(r.stderr)
    return out


def source_key(*parts: str) -> str:
    """12 hex digits over this file, make_awq_fixture.py and ``parts``: a cached fixture's identity."""
    h = hashlib.sha256()
    for f in (Path(__file__).resolve(), HERE / "make_awq_fixture.py"):
        h.update(f.read_bytes())
    for p in parts:
        h.update(p.encode())
    return h.hexdigest()[:12]


def cached(name: str, key: str, build) -> Path:
    """``<pyllm cache>/fixtures/<name>-<key>``, made by ``build(folder)`` once per machine: built in a temporary
    folder under a lock and renamed into place when complete; older ``<name>-*`` folders are removed then."""
    from pyllm.registry import _locked

    root = venv_dir().parent.parent / "fixtures"
    final = root / f"{name}-{key}"
    if (final / ".complete").exists():
        return final
    with _locked(root / f"{name}.lock"):
        if (final / ".complete").exists():
            return final
        tmp = root / f".{name}-{key}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            build(tmp)
            (tmp / ".complete").write_text(key)
            for old in root.glob(f"{name}-*"):
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def cached_fixtures(quiet: bool = True) -> Path:
    """The folder ``write`` fills, cached per machine (keyed by the writer's sources and the venv spec)."""
    return cached(VENV_NAME, source_key(json.dumps(_spec(), sort_keys=True)), lambda d: write(d, "all", quiet))


# ---------------------------------------------------------------------------------------------------- venv side
def _cloned_snapshot_quantizer():
    import torch
    from awq.quantize.quantizer import AwqQuantizer

    class ClonedSnapshotQuantizer(AwqQuantizer):
        """AwqQuantizer whose scale search restores real copies of the weights (see the module docstring)."""

        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, linears2scale, fp16_output, kwargs={}):
            cls_state_dict = type(module2inspect).state_dict
            before = {n: t.detach().clone() for n, t in cls_state_dict(module2inspect).items()}

            def cloned_state_dict(*a, **k):
                return {n: t.detach().clone() for n, t in cls_state_dict(module2inspect, *a, **k).items()}

            module2inspect.state_dict = cloned_state_dict  # only the snapshot at the top of the search
            try:
                best = super()._compute_best_scale(x, w_mean, x_mean, module2inspect, linears2scale, fp16_output,
                                                   kwargs)
            finally:
                del module2inspect.state_dict
            after = cls_state_dict(module2inspect)
            # the search must leave the block as it found it (AwqQuantizer's own snapshot fails this on the CPU)
            bad = [n for n in before if not torch.equal(before[n], after[n])]
            if bad:
                raise RuntimeError(f"AutoAWQ's scale search changed {bad} on the CPU")
            return best

    return ClonedSnapshotQuantizer


def _write_layers(out: Path) -> None:
    import types

    import torch
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import save_file

    tensors = {}
    for g, k, n in LAYER_SPECS:
        torch.manual_seed(g * 100003 + k * 101 + n)
        lin = torch.nn.Linear(k, n, bias=False).half()
        with torch.no_grad():
            lin.weight.normal_(0.0, 0.05)
            lin.weight[:, : min(k, g)] *= 4  # one wide group per row: varied scales
        q = types.SimpleNamespace(w_bit=4, group_size=g, zero_point=True)
        # exactly AwqQuantizer._apply_quant's "gemm" steps
        lin.weight.data, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(q, lin.weight.data)
        scales, zeros = scales.t().contiguous(), zeros.t().contiguous()
        ql = WQLinear_GEMM.from_linear(linear=lin, w_bit=4, group_size=g, init_only=False, scales=scales,
                                       zeros=zeros)
        key = f"g{g}_k{k}_n{n}"
        tensors[f"{key}.qweight"], tensors[f"{key}.qzeros"], tensors[f"{key}.scales"] = ql.qweight, ql.qzeros, ql.scales
        tensors[f"{key}.ref_f16"] = dequantize_gemm(ql.qweight, ql.qzeros, ql.scales, 4, g)
        tensors[f"{key}.ref_f32"] = dequantize_gemm(ql.qweight, ql.qzeros, ql.scales.float(), 4, g)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "layers.safetensors"))


def _write_model(out: Path, name: str) -> None:
    import importlib.util

    import torch
    from awq import AutoAWQForCausalLM
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import save_file

    s = MODEL_SPECS[name]
    spec = importlib.util.spec_from_file_location("make_awq_fixture", HERE / "make_awq_fixture.py")
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    dense, awq_dir = out / f"{name}.dense", out / name
    model, tok = mk.make_dense(dense, arch=s["arch"], tied=s["tied"], seed=s["seed"], hidden=s["hidden"],
                               intermediate=s["intermediate"])
    model.to(getattr(torch, s["dense_dtype"])).save_pretrained(dense)  # the checkpoint dtype AutoAWQ starts from
    kw = {} if s["load_dtype"] == "auto" else {"torch_dtype": getattr(torch, s["load_dtype"])}
    awq_model = AutoAWQForCausalLM.from_pretrained(str(dense), device_map="cpu", **kw)
    gen = torch.Generator().manual_seed(s["seed"])
    calib = torch.randint(0, len(tok), (16, 64), generator=gen).tolist()  # token ids: no tokenizer, no hub
    quant_config = {"zero_point": True, "q_group_size": s["group_size"], "w_bit": 4, "version": "GEMM"}
    awq_model.quantize(None, quant_config=quant_config, calib_data=calib, apply_clip=False, max_calib_samples=16,
                       max_calib_seq_len=64, quantizer_cls=_cloned_snapshot_quantizer())
    awq_model.save_quantized(str(awq_dir))
    tok.save_pretrained(str(awq_dir))
    # the logits reference: every weight as AutoAWQ itself reads it, dequantize_gemm (fp32 scales) for the linears
    ref = {}
    for mod_name, mod in awq_model.model.named_modules():
        if isinstance(mod, WQLinear_GEMM):
            w = dequantize_gemm(mod.qweight, mod.qzeros, mod.scales.float(), 4, mod.group_size)
            ref[mod_name + ".weight"] = w.t().contiguous()
            if mod.bias is not None:
                ref[mod_name + ".bias"] = mod.bias.float()
    for p_name, p in awq_model.model.named_parameters():
        if p_name not in ref:
            ref[p_name] = p.detach().float()
    ref = {k: v.clone() for k, v in ref.items()}  # tied embeddings: separate storage for save_file
    save_file(ref, str(out / f"{name}.ref.safetensors"))


def _in_venv(out: Path, what: str) -> None:
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    t0 = time.perf_counter()
    if what in ("all", "layers"):
        _write_layers(out)
    for name in MODEL_SPECS:
        if what in ("all", name):
            _write_model(out, name)
    print(f"AutoAWQ wrote {what} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "_in_venv":
        _in_venv(Path(sys.argv[2]), sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("venv", help="build the AutoAWQ venv if needed and print its python")
    sub.add_parser("cached", help="write the fixtures once per machine and print their folder")
    w = sub.add_parser("write", help="write the fixtures under OUT")
    w.add_argument("out", type=Path)
    w.add_argument("--only", default="all", choices=["all", "layers", *MODEL_SPECS])
    a = ap.parse_args(argv)
    try:
        if a.cmd == "venv":
            print(ensure_venv(quiet=False))
        elif a.cmd == "cached":
            print(cached_fixtures(quiet=False))
        else:
            print(write(a.out, a.only, quiet=False))
    except (VenvUnavailable, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
