#!/usr/bin/env bash
# Compile-only check of the CUDA sources, for CI machines without a GPU:
#   1. every csrc/cuda/*.cu with nvcc for sm_80 and sm_90 (warnings are errors), with -Xptxas -v; fails if any
#      GEMV or MMQ kernel spills registers.  The sources branch on __CUDA_ARCH__ >= 800 and >= 900 only, so
#      sm_86 and sm_89 compile sm_80's code, and ptxas gives them fewer registers (at most 233 against sm_80's
#      242): CUDA_ARCHS="80 86 89 90" checks them too, at twice the time (~3 min on 2 cores);
#   2. tests/gpu/gemv_host_selftest.cu built with nvcc and RUN on the CPU (the GEMV's per-type slot math,
#      AWQ rows included, against the shared block decoders);
#   3. csrc/cuda/bindings_cuda.cpp syntax-checked against torch's headers, when torch is importable.
# Prints the GEMV register/spill summary.  Env: NVCC (default nvcc), JOBS (parallel nvcc calls, default 2),
# CUDA_ARCHS (the targets, default "80 90"), CUDA_CHECK_OUT (where objects and logs go, default a temp dir),
# TORCH_DIR (torch's package folder, default: where python3 imports it from).
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
JOBS=${JOBS:-2}
OUT=${CUDA_CHECK_OUT:-$(mktemp -d /tmp/pyllm-cuda-check.XXXXXX)}
mkdir -p "$OUT"
command -v "$NVCC" >/dev/null || { echo "check_cuda_compile: $NVCC not found" >&2; exit 1; }

read -r -a ARCHS <<<"${CUDA_ARCHS:-80 90}"
# The same warnings policy as the extension build, plus -Werror.  One nvcc call per (file, target): each log
# then holds one target's ptxas report (nvcc --threads would interleave the targets' lines), and JOBS of
# them run at once.
FLAGS=(-c -std=c++17 -O3 -Icsrc -Xptxas -v --Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror)

start=$(date +%s)
echo "check_cuda_compile: $("$NVCC" --version | tail -1)"
echo "check_cuda_compile: targets ${ARCHS[*]/#/sm_}; logs in $OUT"

pids=()
names=()
wait_slot() { while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 0.5; done; }
for f in csrc/cuda/*.cu; do
    n=$(basename "$f" .cu)
    for a in "${ARCHS[@]}"; do
        wait_slot
        ( "$NVCC" "${FLAGS[@]}" -gencode "arch=compute_$a,code=sm_$a" "$f" -o "$OUT/${n}_sm_$a.o" \
            >"$OUT/${n}_sm_$a.log" 2>&1 ) &
        pids+=($!)
        names+=("${n}_sm_$a")
    done
done
wait_slot
( "$NVCC" -std=c++17 -O1 -Icsrc --Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror \
    tests/gpu/gemv_host_selftest.cu -o "$OUT/gemv_host_selftest" >"$OUT/gemv_host_selftest.log" 2>&1 ) &
pids+=($!)
names+=(gemv_host_selftest)

fail=0
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "FAIL: ${names[$i]}" >&2
        cat "$OUT/${names[$i]}.log" >&2
        fail=1
    fi
done
[ "$fail" = 0 ] || exit 1

# ptxas -v prints per kernel "Function properties for NAME", then "N bytes stack frame, N bytes spill stores,
# N bytes spill loads", then "Used N registers, ...".  NAME mangles the template arguments: QTypeE<id>E,
# Li<M>ELi<R>.  Summarize the GEMV kernels (gemv.cu's and gemv_tiled.cu's, the latter as tQ4_0 ... tAWQ128, AWQ rows
# of group size 128 tiled) and fail on any spill in them.
summary=$(for a in "${ARCHS[@]}"; do
    awk -v arch="sm_$a" '
        BEGIN { split("F32 F16 Q4_0 Q4_1 - - Q5_0 Q5_1 Q8_0 Q8_1 Q2_K Q3_K Q4_K Q5_K Q6_K", tn, " ")
                tn[57] = "AWQ32"; tn[58] = "AWQ64"; tn[59] = "AWQ128"; tn[60] = "AWQ256" }
        /Function properties for/ { name = $NF; getline; st = $5; ld = $9; getline;
            if (name !~ /gemv_(awq_|tiled_)?kernel/) next
            t = "?"; m = "?"
            if (match(name, /QTypeE[0-9]+E/)) { id = substr(name, RSTART + 6, RLENGTH - 7); t = tn[id + 1] }
            if (match(name, /ELi[0-9]+ELi/)) { m = substr(name, RSTART + 3, RLENGTH - 6) }
            if (name ~ /gemv_awq_kernel/) { t = "AWQ"; if (match(name, /ILi[0-9]+ELi/)) m = substr(name, RSTART + 3, RLENGTH - 6) }
            if (name ~ /gemv_tiled_kernel/) t = "t" t  # the tiled layout (gemv_tiled.cu), one line per split W
            printf "%s %-4s M=%s regs=%s spill_st=%s spill_ld=%s\n", arch, t, m, $5, st, ld }
    ' "$OUT/gemv_sm_$a.log" "$OUT/gemv_tiled_sm_$a.log"
done)
echo "$summary" >"$OUT/gemv_ptxas_summary.txt"
n_kernels=$(echo "$summary" | grep -c . || true)
spilling=$(echo "$summary" | awk '$5 != "spill_st=0" || $6 != "spill_ld=0"')
echo "GEMV kernels (type x M x target): $n_kernels (full list: $OUT/gemv_ptxas_summary.txt)"
for a in "${ARCHS[@]}"; do
    echo "$summary" | awk -v a="sm_$a" '$1 == a { split($4, r, "="); if (min == "" || r[2] + 0 < min) min = r[2] + 0;
        if (r[2] + 0 > max) max = r[2] + 0; if ($5 != "spill_st=0" || $6 != "spill_ld=0") sp++; n++ }
        END { if (n) printf "  %s: %d kernels, %d..%d registers, %d spilling\n", a, n, min, max, sp }'
done
echo "  sm_90 registers by type (M=1..8):"
echo "$summary" | awk '$1 == "sm_90" { split($3, m, "="); split($4, r, "="); regs[$2, m[2]] = r[2]; seen[$2] = 1 }
    END { for (t in seen) { line = sprintf("    %-7s", t); for (i = 1; i <= 8; i++) line = line sprintf(" %3s", regs[t, i]); print line } }' | sort
if [ "$n_kernels" -eq 0 ]; then echo "FAIL: no GEMV kernels found in the ptxas output" >&2; exit 1; fi
if [ -n "$spilling" ]; then
    echo "FAIL: GEMV kernels spill registers:" >&2
    echo "$spilling" >&2
    exit 1
fi
# The prefill MMQ kernels (mmq.cu: type x token tile BM): a spill there fails too (two CTAs of 256 threads per SM
# leave 128 registers a thread).
mmq=$(for a in "${ARCHS[@]}"; do
    awk -v arch="sm_$a" '
        BEGIN { split("F32 F16 Q4_0 Q4_1 - - Q5_0 Q5_1 Q8_0 Q8_1 Q2_K Q3_K Q4_K Q5_K Q6_K", tn, " ") }
        /Function properties for/ { name = $NF; getline; st = $5; ld = $9; getline;
            if (name !~ /mmq_kernel/) next
            t = "?"; bm = "?"
            if (match(name, /QTypeE[0-9]+E/)) { id = substr(name, RSTART + 6, RLENGTH - 7); t = tn[id + 1] }
            if (match(name, /ELi[0-9]+E/)) bm = substr(name, RSTART + 3, RLENGTH - 4)
            printf "%s %-4s BM=%s regs=%s spill_st=%s spill_ld=%s\n", arch, t, bm, $5, st, ld }
    ' "$OUT/mmq_sm_$a.log"
done)
echo "MMQ kernels (type x token tile x target): $(echo "$mmq" | grep -c . || true)"
echo "$mmq" | awk '$1 == "sm_90"' | sed 's/^/  /'
if [ "$(echo "$mmq" | grep -c . || true)" -eq 0 ]; then echo "FAIL: no MMQ kernels found in the ptxas output" >&2; exit 1; fi
mmq_spilling=$(echo "$mmq" | awk '$5 != "spill_st=0" || $6 != "spill_ld=0"')
if [ -n "$mmq_spilling" ]; then
    echo "FAIL: MMQ kernels spill registers:" >&2
    echo "$mmq_spilling" >&2
    exit 1
fi
other=$(cat "$OUT"/*_sm_*.log | grep "spill stores" | grep -vc " 0 bytes spill stores, 0 bytes spill loads" || true)
echo "other kernels with spills (not fatal): $other"

"$OUT/gemv_host_selftest"

# bindings: syntax only (torch's CPU wheels lack c10/cuda's generated config header and the CUDA math library
# headers the full CUDAContext needs, so a one-line stub stands in for the former; bindings_cuda.cpp uses
# only c10/cuda stream and guard headers).
# TORCH_DIR (torch's package folder) may be given: CI resolves it before running this beside a pip install.
if TORCH_DIR=${TORCH_DIR:-$(python3 -c "import torch, os; print(os.path.dirname(torch.__file__))" 2>/dev/null)} &&
        [ -n "$TORCH_DIR" ]; then
    CUDA_INC=$(dirname "$(command -v "$NVCC")")/../include
    [ -f "$CUDA_INC/cuda_runtime.h" ] || CUDA_INC=/usr/local/cuda/include
    PY_INC=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
    stub="$OUT/stub"
    if [ ! -f "$TORCH_DIR/include/c10/cuda/impl/cuda_cmake_macros.h" ]; then
        mkdir -p "$stub/c10/cuda/impl"
        : >"$stub/c10/cuda/impl/cuda_cmake_macros.h"
    fi
    ${CXX:-g++} -std=c++17 -fsyntax-only -Wall -Wextra -Werror -Icsrc -isystem "$TORCH_DIR/include" \
        -isystem "$TORCH_DIR/include/torch/csrc/api/include" -isystem "$stub" -isystem "$CUDA_INC" -isystem "$PY_INC" \
        -DTORCH_EXTENSION_NAME=pyllm_C csrc/cuda/bindings_cuda.cpp
    echo "bindings_cuda.cpp: syntax ok"
else
    echo "bindings_cuda.cpp: torch not importable, syntax check skipped"
fi
echo "check_cuda_compile: ok in $(( $(date +%s) - start )) s"
