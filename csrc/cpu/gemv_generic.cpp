// Scalar ("_generic") row dots for every CPU type, and the scalar activation quantizers.
//
// These are the readable definition of what each SIMD kernel computes, and the run-time fallback
// (pyllm._C.set_isa("scalar")): each block's integer codes are decoded once, then dotted with every
// activation row, so even here W is read once per call.  The integer sums are exactly the SIMD kernels'
// sums; only the order of the fp32 block accumulation differs, so scalar and AVX2 agree to ~1e-6.
//
// Precision (both ISAs):
//   F32/F16/BF16 weights: weights widened exactly to fp32, x unquantized, fp32 products and sums (8 partial
//     sums, like one AVX2 register).
//   Q4_0/Q4_1/Q5_0/Q5_1: x rounded to int8 per 32 values with an fp32 scale (|error| <= max|x|/254 per
//     value), exact int32 block dot products, fp32 scaling and accumulation per block.
//   Q8_0 asked for 16-bit activations (gemv_cpu's precise_x, the output projection): x rounded to int16
//     (|error| <= max|x|/65534 per value), see Q16Row in cpu_impl.h.
//   MXFP4: as Q4_0, with the codes' doubled E2M1 values offset by 12 (0..24) and the E8M0 scale.
//   K-quants: x rounded to int8 per 256 values (ggml's Q8_K), exact int32 sums per super-block, fp32 after.
//   AWQ rows (AWQ_G32 ... AWQ_G256): as Q4_1 -- x rounded to int8 per 32 values (|error| <= max|x|/254 per
//     value), exact int32 block sums sum(q * xq) and sum(xq), then per block s_g * (dx * sum(q * xq) - z_g * s_b)
//     in fp32, accumulated in fp32.  Against the float64 product on the exact weights the error is the int8
//     rounding of x (~0.5% of an output's rms for Gaussian x), plus ~1e-7 relative of fp32.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "../common/decode.h"
#include "cpu_impl.h"

namespace pyllm {
namespace cpu {
namespace {

template <class A>
inline const A* act_row(const uint8_t* xa, size_t xs, int m) {
    return reinterpret_cast<const A*>(xa + static_cast<size_t>(m) * xs);
}

// ---- float weights ------------------------------------------------------------------------------------
template <class T>
inline float widen(T v);
template <>
inline float widen<float>(float v) { return v; }

struct F16Bits { uint16_t v; };
struct BF16Bits { uint16_t v; };
template <>
inline float widen<F16Bits>(F16Bits v) { return fp16_to_fp32(v.v); }
template <>
inline float widen<BF16Bits>(BF16Bits v) { return bf16_to_fp32(v.v); }

template <class T, int M>
void dot_float(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    const T* wr = reinterpret_cast<const T*>(w);
    float acc[M][8] = {};
    int k = 0;
    for (; k + 8 <= K; k += 8)
        for (int l = 0; l < 8; ++l) {
            const float wv = widen<T>(wr[k + l]);
            for (int m = 0; m < M; ++m) acc[m][l] += wv * act_row<float>(xa, xs, m)[k + l];
        }
    for (; k < K; ++k) {
        const float wv = widen<T>(wr[k]);
        for (int m = 0; m < M; ++m) acc[m][0] += wv * act_row<float>(xa, xs, m)[k];
    }
    for (int m = 0; m < M; ++m) {
        float s = 0.f;
        for (int l = 0; l < 8; ++l) s += acc[m][l];
        y[m * ldy] = s;
    }
}

// ---- 32-element blocks against Q8Row activations ----------------------------------------------------------
// value = (code - Offset) * d (+ m when the type has mins); per block and activation row:
//   sum_j value_j * xq_j * dx = d * (dx * sum(code * xq) - Offset * s) + m * s,   s = dx * sum(xq)
template <class B>
struct Legacy;
template <>
struct Legacy<block_q4_0> {
    static constexpr int offset = 8;
    static int code(const block_q4_0& b, int j) { return q4_0_code(b, j); }
    static float min(const block_q4_0&) { return 0.f; }
};
template <>
struct Legacy<block_q4_1> {
    static constexpr int offset = 0;
    static int code(const block_q4_1& b, int j) { return q4_1_code(b, j); }
    static float min(const block_q4_1& b) { return fp16_to_fp32(b.m); }
};
template <>
struct Legacy<block_q5_0> {
    static constexpr int offset = 16;
    static int code(const block_q5_0& b, int j) { return q5_0_code(b, j); }
    static float min(const block_q5_0&) { return 0.f; }
};
template <>
struct Legacy<block_q5_1> {
    static constexpr int offset = 0;
    static int code(const block_q5_1& b, int j) { return q5_1_code(b, j); }
    static float min(const block_q5_1& b) { return fp16_to_fp32(b.m); }
};

template <>
struct Legacy<block_q8_0> {
    static constexpr int offset = 0;
    static int code(const block_q8_0& b, int j) { return b.qs[j]; }
    static float min(const block_q8_0&) { return 0.f; }
};

template <>
struct Legacy<block_mxfp4> {  // value = (code - 12) * d with code = kvalue + 12 in 0..24, as the SIMD kernels take it
    static constexpr int offset = 12;
    static int code(const block_mxfp4& b, int j) { return mxfp4_value(mxfp4_code(b, j)) + 12; }
    static float min(const block_mxfp4&) { return 0.f; }
};

inline float block_scale(const block_mxfp4& b) { return e8m0_to_fp32_half(b.e); }
template <class B>
inline float block_scale(const B& b) { return fp16_to_fp32(b.d); }

template <class B, int M>
void dot_legacy(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    const B* blk = reinterpret_cast<const B*>(w);
    float acc[M] = {};
    for (int i = 0; i < K / QK; ++i) {
        int q[QK];
        for (int j = 0; j < QK; ++j) q[j] = Legacy<B>::code(blk[i], j);
        const float d = block_scale(blk[i]), mn = Legacy<B>::min(blk[i]);
        for (int m = 0; m < M; ++m) {
            const Q8RowC a = q8_row(xa + xs * m, K);
            int isum = 0;
            for (int j = 0; j < QK; ++j) isum += q[j] * a.qs[QK * i + j];
            acc[m] += d * (a.d[i] * static_cast<float>(isum) - static_cast<float>(Legacy<B>::offset) * a.s[i]) +
                      mn * a.s[i];
        }
    }
    for (int m = 0; m < M; ++m) y[m * ldy] = acc[m];
}

// ---- AWQ rows (blocks.h) against Q8Row activations ----------------------------------------------------------
// value = (q - z) * s per group of G; per 32-block b of group g and activation row m:
//   sum_j value_j * xq_j * dx = s * (dx * sum(q * xq) - z * s_b),   s_b = dx * sum(xq)
template <int G, int M>
void dot_awq(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    const AwqRow r = awq_row(w, K, G);
    float acc[M] = {};
    for (int i = 0; i < K / QK; ++i) {
        const int g = i / (G / QK);
        const float s = awq_scale(r, g), z = static_cast<float>(r.z[g]);
        int q[QK];
        for (int j = 0; j < QK; ++j) q[j] = awq_code(r.qs, QK * i + j);
        for (int m = 0; m < M; ++m) {
            const Q8RowC a = q8_row(xa + xs * m, K);
            int isum = 0;
            for (int j = 0; j < QK; ++j) isum += q[j] * a.qs[QK * i + j];
            acc[m] += s * (a.d[i] * static_cast<float>(isum) - z * a.s[i]);
        }
    }
    for (int m = 0; m < M; ++m) y[m * ldy] = acc[m];
}

// ---- K-quants against block_q8_K ------------------------------------------------------------------------
// Per super-block and activation row: d * dx * sum_g scale_g * dot_g(code, xq) - dmin * dx * sum_g min_g * bsum_g
// with groups of 16 (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K) elements.
template <int M, int G, class CodeFn>
inline void kquant_block(const int* sc, const int* mn, float d, float dmin, const uint8_t* xa, size_t xs, int i,
                         CodeFn code, float* acc) {
    int q[QK_K];
    for (int e = 0; e < QK_K; ++e) q[e] = code(e);
    for (int m = 0; m < M; ++m) {
        const block_q8_K& a = act_row<block_q8_K>(xa, xs, m)[i];
        int sumi = 0, summ = 0;
        for (int g = 0; g < QK_K / G; ++g) {
            int dot = 0, bs = 0;
            for (int l = 0; l < G; ++l) dot += q[G * g + l] * a.qs[G * g + l];
            for (int h = 0; h < G / 16; ++h) bs += a.bsums[(G / 16) * g + h];
            sumi += sc[g] * dot;
            summ += mn[g] * bs;
        }
        acc[m] += d * a.d * static_cast<float>(sumi) - dmin * a.d * static_cast<float>(summ);
    }
}

template <int M>
void dot_q2_k(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    const block_q2_K* blk = reinterpret_cast<const block_q2_K*>(w);
    float acc[M] = {};
    for (int i = 0; i < K / QK_K; ++i) {
        const block_q2_K& b = blk[i];
        int sc[16], mn[16];
        for (int g = 0; g < 16; ++g) sc[g] = b.scales[g] & 0xF, mn[g] = b.scales[g] >> 4;
        kquant_block<M, 16>(sc, mn, fp16_to_fp32(b.d), fp16_to_fp32(b.dmin), xa, xs, i,
                            [&](int e) { return q2_k_code(b, e); }, acc);
    }
    for (int m = 0; m < M; ++m) y[m * ldy] = acc[m];
}

template <int M>
void dot_q3_k(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    const block_q3_K* blk = reinterpret_cast<const block_q3_K*>(w);
    float acc[M] = {};
    for (int i = 0; i < K / QK_K; ++i) {
        const block_q3_K& b = blk[i];
        int sc[16], mn[16] = {};
        for (int g = 0; g < 16; ++g) sc[g] = q3_k_scale(b.scales, g);
        kquant_block<M, 16>(sc, mn, fp16_to_fp32(b.d), 0.f, xa, xs, i, [&](int e) { return q3_k_code(b, e); }, acc);
    }
    for (int m = 0; m < M; ++m) y[m * ldy] = acc[m];
}

template <class B, int M>
void dot_q45_k(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    const B* blk = reinterpret_cast<const B*>(w);
    float acc[M] = {};
    for (int i = 0; i < K / QK_K; ++i) {
        const B& b = blk[i];
        int sc[8], mn[8];
        for (int g = 0; g < 8; ++g) {
            uint8_t s, mm;
            get_scale_min_k4(g, b.scales, &s, &mm);
            sc[g] = s, mn[g] = mm;
        }
        auto code = [&](int e) {
            if constexpr (sizeof(B) == sizeof(block_q4_K)) return q4_k_code(b, e);
            else return q5_k_code(b, e);
        };
        kquant_block<M, 32>(sc, mn, fp16_to_fp32(b.d), fp16_to_fp32(b.dmin), xa, xs, i, code, acc);
    }
    for (int m = 0; m < M; ++m) y[m * ldy] = acc[m];
}

template <int M>
void dot_q6_k(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    const block_q6_K* blk = reinterpret_cast<const block_q6_K*>(w);
    float acc[M] = {};
    for (int i = 0; i < K / QK_K; ++i) {
        const block_q6_K& b = blk[i];
        int sc[16], mn[16] = {};
        for (int g = 0; g < 16; ++g) sc[g] = b.scales[g];
        kquant_block<M, 16>(sc, mn, fp16_to_fp32(b.d), 0.f, xa, xs, i, [&](int e) { return q6_k_code(b, e); }, acc);
    }
    for (int m = 0; m < M; ++m) y[m * ldy] = acc[m];
}

template <int M> void dot_f32(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_float<float, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_f16(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_float<F16Bits, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_bf16(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_float<BF16Bits, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q4_0(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q4_0, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q4_1(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q4_1, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q5_0(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q5_0, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q5_1(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q5_1, M>(K, w, xa, xs, y, ldy); }
// Q8_0 against int16 activations: per block d_w * d_x * sum(code * xq), the int32 sum exact.
template <int M> void dot_mxfp4(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_mxfp4, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q8_0(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q8_0, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_awq32(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_awq<32, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_awq64(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_awq<64, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_awq128(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_awq<128, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_awq256(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_awq<256, M>(K, w, xa, xs, y, ldy); }

template <int M>
void dot_q8_0_x16(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    const block_q8_0* blk = reinterpret_cast<const block_q8_0*>(w);
    float acc[M] = {};
    for (int i = 0; i < K / QK; ++i) {
        const float d = fp16_to_fp32(blk[i].d);
        for (int m = 0; m < M; ++m) {
            const Q16RowC a = q16_row(xa + xs * m, K);
            int isum = 0;
            for (int j = 0; j < QK; ++j) isum += blk[i].qs[j] * a.qs[QK * i + j];
            acc[m] += d * a.d[i] * static_cast<float>(isum);
        }
    }
    for (int m = 0; m < M; ++m) y[m * ldy] = acc[m];
}
template <int M> void dot_q4_k(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_q45_k<block_q4_K, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q5_k(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_q45_k<block_q5_K, M>(K, w, xa, xs, y, ldy); }

}  // namespace

RowKernel row_kernel_generic(QType t) {
    switch (t) {
        case QType::F32: return {Act::F32, PYLLM_ROWDOT_TABLE(dot_f32)};
        case QType::F16: return {Act::F32, PYLLM_ROWDOT_TABLE(dot_f16)};
        case QType::BF16: return {Act::F32, PYLLM_ROWDOT_TABLE(dot_bf16)};
        case QType::Q4_0: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q4_0)};
        case QType::Q4_1: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q4_1)};
        case QType::Q5_0: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q5_0)};
        case QType::Q5_1: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q5_1)};
        case QType::Q8_0: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q8_0)};
        case QType::MXFP4: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_mxfp4)};
        case QType::Q2_K: return {Act::Q8_K, PYLLM_ROWDOT_TABLE(dot_q2_k)};
        case QType::Q3_K: return {Act::Q8_K, PYLLM_ROWDOT_TABLE(dot_q3_k)};
        case QType::Q4_K: return {Act::Q8_K, PYLLM_ROWDOT_TABLE(dot_q4_k)};
        case QType::Q5_K: return {Act::Q8_K, PYLLM_ROWDOT_TABLE(dot_q5_k)};
        case QType::Q6_K: return {Act::Q8_K, PYLLM_ROWDOT_TABLE(dot_q6_k)};
        case QType::AWQ_G32: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_awq32)};
        case QType::AWQ_G64: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_awq64)};
        case QType::AWQ_G128: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_awq128)};
        case QType::AWQ_G256: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_awq256)};
        default: return {};
    }
}

RowKernel row_kernel_generic_x16(QType t) {
    return t == QType::Q8_0 ? RowKernel{Act::Q16_32, PYLLM_ROWDOT_TABLE(dot_q8_0_x16)} : RowKernel{};
}

// ---- activation quantizers ------------------------------------------------------------------------------
// Symmetric int8 with the fp32 scale d = max|x| / 127; q = round-half-even(x * (1/d)), exactly what
// _mm256_cvtps_epi32 does, so the AVX2 quantizers produce the same bytes.
// max |x| over n values, or NaN where one of them is NaN or infinite.  A block holding one gets zero codes and a NaN
// scale, so every dot product with it is NaN: a broken activation reaches the logits, where the runtime reports
// it, instead of being rounded into finite codes (fmax drops NaN; x * (1/d) of an infinity is NaN).
float amax_or_nan(const float* x, int n) {
    float amax = 0.f;
    bool finite = true;
    for (int j = 0; j < n; ++j) {
        const float a = std::fabs(x[j]);
        finite &= a <= FLT_MAX;
        amax = std::fmax(amax, a);
    }
    return finite ? amax : NAN;
}

void quantize_q8_32_generic(const float* x, int K, Q8Row out) {
    for (int i = 0; i < K / QK; ++i) {
        const float* xb = x + QK * i;
        const float amax = amax_or_nan(xb, QK);
        if (std::isnan(amax)) {
            std::fill(out.qs + QK * i, out.qs + QK * (i + 1), static_cast<int8_t>(0));
            out.d[i] = out.s[i] = NAN;
            out.sum[i] = 0;
            continue;
        }
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int j = 0; j < QK; ++j) {
            const int q = static_cast<int>(std::nearbyint(xb[j] * id));
            out.qs[QK * i + j] = static_cast<int8_t>(q);
            sum += q;
        }
        out.d[i] = d;
        out.s[i] = d * static_cast<float>(sum);
        out.sum[i] = sum;
    }
}

// Symmetric int16 with d = max|x| / 32767, the same rounding.
void quantize_q16_32_generic(const float* x, int K, Q16Row out) {
    for (int i = 0; i < K / QK; ++i) {
        const float* xb = x + QK * i;
        const float amax = amax_or_nan(xb, QK);
        if (std::isnan(amax)) {
            std::fill(out.qs + QK * i, out.qs + QK * (i + 1), static_cast<int16_t>(0));
            out.d[i] = NAN;
            continue;
        }
        const float d = amax / 32767.f, id = d != 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < QK; ++j) out.qs[QK * i + j] = static_cast<int16_t>(std::nearbyint(xb[j] * id));
        out.d[i] = d;
    }
}

void quantize_q8_K_generic(const float* x, int K, block_q8_K* out) {
    for (int i = 0; i < K / QK_K; ++i) {
        const float* xb = x + QK_K * i;
        const float amax = amax_or_nan(xb, QK_K);
        if (std::isnan(amax)) {
            out[i] = block_q8_K{};
            out[i].d = NAN;
            continue;
        }
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        for (int g = 0; g < QK_K / 16; ++g) {
            int sum = 0;
            for (int l = 0; l < 16; ++l) {
                const int q = static_cast<int>(std::nearbyint(xb[16 * g + l] * id));
                out[i].qs[16 * g + l] = static_cast<int8_t>(q);
                sum += q;
            }
            out[i].bsums[g] = static_cast<int16_t>(sum);
        }
        out[i].d = d;
    }
}

}  // namespace cpu
}  // namespace pyllm
