// Quantized rows -> fp32 rows (prefill's dequantize-then-GEMM path, embedding lookups, ops.dequantize).
// Bit-identical to gguf.quants.dequantize (see decode.h); the AVX2 versions (gemv_avx2_*.cpp) keep the same
// separate multiply / add roundings, and the tests check both ISAs against gguf.quants.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../common/decode.h"
#include "cpu_impl.h"
#include "../kernels.h"

namespace pyllm {
namespace {

template <class B, int bs>
void dequant_row(const uint8_t* w, int K, float* out) {
    const B* b = reinterpret_cast<const B*>(w);
    for (int i = 0; i < K / bs; ++i) dequant_block(b[i], out + static_cast<size_t>(bs) * i);
}

void dequant_row_any(QType t, const uint8_t* w, int K, float* out, bool simd) {
    if (simd && (cpu::dequant_row_avx2_legacy(t, w, K, out) || cpu::dequant_row_avx2_kquants(t, w, K, out) ||
                 cpu::dequant_row_avx2_awq(t, w, K, out)))
        return;
    switch (t) {
        case QType::F32: memcpy(out, w, sizeof(float) * K); return;
        case QType::F16: {
            const uint16_t* h = reinterpret_cast<const uint16_t*>(w);
            for (int k = 0; k < K; ++k) out[k] = fp16_to_fp32(h[k]);
            return;
        }
        case QType::BF16: {
            const uint16_t* h = reinterpret_cast<const uint16_t*>(w);
            for (int k = 0; k < K; ++k) out[k] = bf16_to_fp32(h[k]);
            return;
        }
        case QType::Q4_0: return dequant_row<block_q4_0, QK>(w, K, out);
        case QType::Q4_1: return dequant_row<block_q4_1, QK>(w, K, out);
        case QType::Q5_0: return dequant_row<block_q5_0, QK>(w, K, out);
        case QType::Q5_1: return dequant_row<block_q5_1, QK>(w, K, out);
        case QType::Q8_0: return dequant_row<block_q8_0, QK>(w, K, out);
        case QType::MXFP4: return dequant_row<block_mxfp4, QK>(w, K, out);
        case QType::Q2_K: return dequant_row<block_q2_K, QK_K>(w, K, out);
        case QType::Q3_K: return dequant_row<block_q3_K, QK_K>(w, K, out);
        case QType::Q4_K: return dequant_row<block_q4_K, QK_K>(w, K, out);
        case QType::Q5_K: return dequant_row<block_q5_K, QK_K>(w, K, out);
        case QType::Q6_K: return dequant_row<block_q6_K, QK_K>(w, K, out);
        case QType::AWQ_G32:
        case QType::AWQ_G64:
        case QType::AWQ_G128:
        case QType::AWQ_G256: return dequant_awq_row(w, K, cpu::awq_group_size(t), out);
        default: return;  // bindings reject unsupported types before we get here
    }
}

}  // namespace

namespace cpu {
void dequantize_row(QType t, const uint8_t* w, int K, float* out) {
    // Every SIMD ISA has the AVX2 decoders (AVX-512 and AMX hosts have AVX2): the AMX / AVX-512 prefill GEMM
    // decodes its weight strips here, and the scalar decoders are several times slower.
    dequant_row_any(t, w, K, out, cpu_isa_simd(cpu_get_isa()));
}
}  // namespace cpu

void dequantize_rows_cpu(QType t, const uint8_t* w, size_t row_bytes, const int64_t* ids, int64_t n_ids, int K,
                         float* out) {
    // A handful of rows (an embedding lookup at decode) is not worth waking threads for.
    const int nt = n_ids * static_cast<int64_t>(K) >= (1 << 16) ? cpu_get_num_threads() : 1;
    const bool simd = cpu_isa_simd(cpu_get_isa());
    if (is_rows8(t)) {  // row r is row r % 8 of its group: unpacked to its GGUF blocks first
        const QType base = rows8_base(t);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
        for (int64_t i = 0; i < n_ids; ++i) {
            thread_local std::vector<uint8_t> row;
            row.resize(row_bytes);
            const int64_t r = ids ? ids[i] : i;
            unpack_rows8_row(t, w + row_bytes * (r & ~int64_t{7}), K, static_cast<int>(r & 7), row.data());
            dequant_row_any(base, row.data(), K, out + static_cast<size_t>(K) * i, simd);
        }
        return;
    }
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t i = 0; i < n_ids; ++i) {
        const int64_t r = ids ? ids[i] : i;
        dequant_row_any(t, w + row_bytes * r, K, out + static_cast<size_t>(K) * i, simd);
    }
}

}  // namespace pyllm
