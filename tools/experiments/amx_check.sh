#!/usr/bin/env bash
# The AMX-INT8 rows kernels (csrc/cpu/rows8_amx.cpp, off by default) checked and measured in one go, on a CPU with
# AMX-INT8 (Sapphire Rapids and later):
#
#     bash tools/experiments/amx_check.sh [THREADS]        # ~10 minutes on 2 cores; run it on a quiet machine
#
# 1. the tests that run the native tiles there (every rows-by-8 type and M against the VNNI kernels' bits; the
#    multi-row decode step against one-row steps);
# 2. the rows kernels alone, AMX tiles against VNNI, interleaved per point (int8 and the output's int16
#    activations);
# 3. SmolLM2's 8-row verification pass profiled, and `pyllm bench --spec`, each with PYLLM_AMX_ROWS=1 and without,
#    alternated three times.
# What it found is in docs/BENCHMARKS.md ("AMX-INT8 rows kernels"): the tiles are slower than VNNI, so they stay off
# (isa.cpp amx_rows_mode).
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${1:-2}

python - <<'EOF'
from pyllm import _ext

m = _ext.load()
if not m.amx_int8_usable():
    raise SystemExit("amx_check: this CPU or OS offers no AMX-INT8 tiles (CPUID, XCR0 or Linux's tile permission): "
                     f"nothing to check here (kernels: {m.best_isa()} of {'/'.join(m.available_isas())})")
print(f"amx_check: AMX-INT8 usable; kernels {m.best_isa()} of {'/'.join(m.available_isas())}")
EOF

echo "== 1. tests (native tiles)"
python -m pytest -q tests/test_kernels.py tests/test_speculative.py -k "amx_rows or rows_equal"

echo "== 2. rows kernels: VNNI vs AMX tiles"
python tools/bench_kernels.py --rows8 --isa amx --amx-rows off,native --types Q4_1,Q8_0,Q4_K,Q6_K \
    --shapes 1536x576,576x1536,4864x896,896x4864 --m 2,4,8 --threads "$T" --repeat 5
python tools/bench_kernels.py --rows8 --precise-x --isa amx --amx-rows off,native --types Q8_0 \
    --shapes 49152x576,151936x896 --m 2,4,8 --threads "$T" --repeat 5

echo "== 3. SmolLM2's 8-row pass and speculation, without and with PYLLM_AMX_ROWS=1 (alternated)"
for round in 1 2 3; do
    for amx in 0 1; do
        echo "-- round $round, PYLLM_AMX_ROWS=$amx"
        PYLLM_AMX_ROWS=$amx python tools/decode_profile.py smollm2-135m -t "$T" --depth 300 --rows 8 -r 3 | tail -1
    done
done
for amx in 0 1; do
    echo "-- pyllm bench --spec, PYLLM_AMX_ROWS=$amx"
    PYLLM_AMX_ROWS=$amx python -m pyllm bench smollm2-135m qwen2.5-coder-0.5b --spec lookup -r 3 -t "$T"
done
