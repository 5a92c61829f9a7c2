#!/usr/bin/env bash
# One-shot GPU validation for a fresh device machine (H200: torch 2.11 cu130, nvcc 13.0), within 8 minutes:
#   1. build the one extension with its CUDA kernels (pyllm/_ext.py), sm_90 only;
#   2. pytest tests/gpu (float64 references, gguf.quants oracle, every KV cache kind, AWQ, Gemma 3,
#      device="cuda" against device="cpu" end to end: logits KL and 32 greedy tokens, and the batched step's rows
#      equal to each sequence alone, bit for bit: test_batch_step.py), the host-compiled row
#      reader and the build lock (tests/test_cuda_backend_host.py is CPU-only and runs with the CPU suite);
#   3. pyllm run and a piped pyllm chat on --device cuda (a tiny converted model);
#   4. GEMV GB/s vs copy bandwidth per type (AWQ int4 at group size 128 too) and 8B shape, in one run: the GGUF-order
#      kernel (gemv.cu; for AWQ its row kernel) and the tiled one (gemv_tiled.cu: its automatic K split, with
#      PYLLM_CUDA_PDL=1, each split forced), a 512-token chunk's
#      matrix product per tiled type and 8B shape through MMQ (mmq.cu) and through dequantize + fp16 cuBLAS, synthetic
#      Llama-3-8B pp512 (tiled: MMQ beside dequantize + fp16 cuBLAS, PYLLM_CUDA_MMQ=0, on the same weights)/tg128 and
#      tg after a long prompt with f16 and q8_0 caches, weights in GGUF order and tiled (+ fp16 torch
#      baseline, + the step in torch ops, + the row kernels with programmatic dependent launches, PYLLM_CUDA_PDL=1;
#      + aggregate tok/s of 1, 4, 8, 16 and 64 streams through the batched step, CudaBackend.step, one table row), the KL
#      of a real model
#      cut to its first layers (CUDA and CPU against float32), then `pyllm bench --synthetic ... --device cuda`,
#      and the synthetic 8B's pp512 / tg32 with half its layers on the GPU (--gpu-layers 16, the rest on the CPU);
# and prints a short table last.  Logs and bench.json go to $OUT (the device tool's folder) or /tmp.
#
# Missing packages (gguf, maybe prompt_toolkit) travel as wheels in .whl/ (carry ".whl"); prepare them here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 --platform any -d .whl gguf==0.19.0 prompt_toolkit wcwidth
# A real model for the KL check travels cut to its first layers (SmolLM2 to 8 layers is 49.6 MB of the 64 MiB a call
# carries; carry ".gpu_models" too):
#   echo /.gpu_models/ >> .git/info/exclude
#   python tools/requantize_gguf.py smollm2-135m keep .gpu_models/smollm2-8l.gguf --layers 8
# Env: GPU_CHECK_SKIP_BENCH=1 (tests only), GPU_CHECK_CTX (long-context position, default 4096),
#      GPU_CHECK_KL_MODEL (default: .gpu_models/smollm2-8l.gguf when it exists).
# On the H200 (2026-12-04) the whole script ran in ~5 minutes: build ~55 s, tests ~100 s under pytest-xdist, the
# CLI ~30 s, benchmarks ~90 s; a device call also pays ~1 minute to start.  PYTEST_ADDOPTS=--timeout=90 bounds a
# hung test.  tools/gpu_profile.py ranks one token's kernels (~40 s more) when the numbers need explaining.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp/pyllm-gpu-check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
export PYLLM_CACHE_DIR=${PYLLM_CACHE_DIR:-/tmp/pyllm-cache}
t0=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$LOG/device.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$LOG/device.txt"
python3 -c "import gguf" 2>/dev/null || echo "WARNING: gguf is not importable: the oracle tests will fail (carry .whl)"

stamp "build"
timeout 300 python3 -c "
import time; t = time.time()
from pyllm.backends import cuda
b = cuda.create('cuda')
print('CUDA backend', b.describe(), 'kernels built/loaded in %.0f s' % (time.time() - t))
" 2>&1 | tee "$LOG/build.log"
build_rc=${PIPESTATUS[0]}
[ "$build_rc" = 0 ] || { stamp "BUILD FAILED (rc $build_rc)"; exit 1; }

stamp "tests/gpu"
# Parallel workers where pytest-xdist is installed: faster, and a test that crashes its process fails alone.
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider $xdist tests/gpu tests/test_cuda_host.py \
    tests/test_ext_build_lock.py 2>&1 | tee "$LOG/tests.log"
test_rc=${PIPESTATUS[0]}

stamp "pyllm run / chat on cuda"
timeout 90 python3 - <<'PY' 2>&1 | tee "$LOG/cli.log"
import subprocess, sys
sys.path.insert(0, "tests")
from tiny_models import gguf_path
p = str(gguf_path("qwen3", "q4_0"))
for args, stdin in ((["run", p, "Once upon a time", "-n", "16", "--temp", "0", "--device", "cuda"], None),
                    (["chat", p, "--device", "cuda", "-n", "16"], "hello\n/bye\n")):
    r = subprocess.run([sys.executable, "-m", "pyllm", *args], input=stdin, capture_output=True, text=True, timeout=60)
    print("pyllm", args[0], "rc", r.returncode, "|", (r.stdout + r.stderr).strip()[-300:].replace("\n", " / "))
PY

bench_rc=skipped
if [ "${GPU_CHECK_SKIP_BENCH:-0}" != 1 ]; then
    stamp "benchmarks"
    kl_model=${GPU_CHECK_KL_MODEL:-.gpu_models/smollm2-8l.gguf}
    kl_arg=()
    [ -f "$kl_model" ] && kl_arg=(--kl-model "$kl_model")
    timeout 300 python3 tests/gpu/bench_cuda.py --out "$LOG" --ctx "${GPU_CHECK_CTX:-4096}" "${kl_arg[@]}" 2>&1 \
        | tee "$LOG/bench.log"
    bench_rc=${PIPESTATUS[0]}
    # the CLI's own numbers, shares of the GPU's measured copy bandwidth and fp16 matmul rate
    timeout 150 python3 -m pyllm bench --synthetic llama3-1b:q4_k_m --device cuda -p 512 -n 128 -r 2 2>&1 \
        | tail -8 | tee "$LOG/pyllm_bench.log"
    # --gpu-layers: the synthetic 8B with half its layers (16 of 32) and their KV cache on the GPU, the other 16,
    # the embedding and the output head on the CPU's kernels (every token through the per-layer torch forward)
    timeout 180 python3 -m pyllm bench --synthetic llama3-8b:q4_k_m --device cuda -ngl 16 -p 512 -n 32 -r 1 2>&1 \
        | tail -4 | tee "$LOG/gpu_layers_bench.log"
fi

stamp "done"
echo "=== summary ==="
cat "$LOG/device.txt"
echo "tests: $(tail -1 "$LOG/tests.log") (rc $test_rc)"
cat "$LOG/cli.log"
if [ "$bench_rc" != skipped ]; then
    grep '"mean KL' "$LOG/bench.log"
    sed -n '/^=== GEMV/,$p' "$LOG/bench.log"
    echo "bench rc $bench_rc"
    cat "$LOG/pyllm_bench.log"
    echo "--gpu-layers 16 of 32 (synthetic Llama-3-8B Q4_K_M):"
    grep '^| synthetic' "$LOG/gpu_layers_bench.log"
fi
[ "$test_rc" = 0 ] && { [ "$bench_rc" = 0 ] || [ "$bench_rc" = skipped ]; }
