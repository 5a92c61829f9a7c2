// Small AVX2 helpers shared by the gemv_avx2_*.cpp files.  Included only when PYLLM_AVX2 is set.
//
// gemv_avx512.cpp includes this header (and gemv_legacy_impl.h) a second time under
// `#pragma GCC target(... avx512vnni)` with PYLLM_VNNI defined: the helpers then live in namespace avx512 (so
// the two builds of each inline function never share a symbol) and dot_u8s8 becomes one vpdpbusd.  The pragma
// does not define __AVX2__ etc. in g++, hence the explicit PYLLM_VNNI test.  gemv_vnni_emulated.cpp includes them a
// third time, as AVX2 code with PYLLM_VNNI_EMULATED also defined (namespace vnni_emulated): the VNNI kernels'
// code made runnable on an AVX2-only CPU, for tests.
#pragma once

#if (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || defined(PYLLM_VNNI)
#define PYLLM_AVX2 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu_impl.h"  // PYLLM_PREFETCH

#if defined(PYLLM_VNNI_EMULATED)
#define PYLLM_SIMD_NS vnni_emulated
#elif defined(PYLLM_VNNI)
#define PYLLM_SIMD_NS avx512
#else
#define PYLLM_SIMD_NS avx2
#endif

namespace pyllm {
namespace cpu {
namespace PYLLM_SIMD_NS {

#define PYLLM_INLINE inline __attribute__((always_inline))

// Row m of the prepared activations (rows of xs bytes holding blocks of type A).
template <class A>
PYLLM_INLINE const A* act_row(const uint8_t* xa, size_t xs, int m) {
    return reinterpret_cast<const A*>(xa + static_cast<size_t>(m) * xs);
}

// An empty asm that takes v and gives it back in a register: gcc can neither reassociate a running sum across it
// nor keep the sum on the stack at that point.  Unhindered, it turns M running integer sums into trees of
// products computed ahead, or moves fp32 accumulators to the stack, which puts a store-reload on every block's
// dependency chain; either spills and runs 1.2-1.3x slower at M = 4-8.
PYLLM_INLINE void keep_in_register(__m256i& v) { __asm__("" : "+x"(v)); }
PYLLM_INLINE void keep_in_register(__m256& v) { __asm__("" : "+x"(v)); }

PYLLM_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

PYLLM_INLINE float hsum(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

PYLLM_INLINE int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

PYLLM_INLINE float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

PYLLM_INLINE float f16(uint16_t h) { return _cvtsh_ss(h); }

// Software prefetch of the weight stream, WEIGHT_PREFETCH bytes ahead of the bytes being decoded (cpu_impl.h).
#if defined(PYLLM_VNNI) && !defined(PYLLM_VNNI_EMULATED)
constexpr int WEIGHT_PREFETCH = PYLLM_PREFETCH_VNNI;
#else
constexpr int WEIGHT_PREFETCH = PYLLM_PREFETCH;
#endif
template <int Bytes>
PYLLM_INLINE void prefetch_ahead(const void* p) {
    if constexpr (WEIGHT_PREFETCH > 0) {
        const char* c = static_cast<const char*>(p) + WEIGHT_PREFETCH;
        for (int l = 0; l < Bytes; l += 64) _mm_prefetch(c + l, _MM_HINT_T0);
    } else {
        (void)p;
    }
}

#if defined(PYLLM_VNNI) && !defined(PYLLM_VNNI_EMULATED)
// Two 8-row groups side by side in one zmm register (lanes 0-7 group g's rows, 8-15 group g + 1's), as the rows
// kernels' pairs read them: 32 bytes of each group, and each group's 8 fp16 scales as 16 floats.
PYLLM_INLINE __m512i pair_of(const void* p0, const void* p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1);
}
PYLLM_INLINE __m512 pair_f16x8(const void* p0, const void* p1) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1));
}
#endif

// 16 packed bytes of nibbles -> 32 bytes: low nibbles in bytes 0..15, high nibbles in 16..31 (the element
// order of every 32-block and of each Q4_K 64-chunk's two halves).
// (broadcast load + per-lane variable shift: 2 vector ALU uops, where srli + vinserti128 + and take 3)
PYLLM_INLINE __m256i nibbles_32(const uint8_t* qs) {
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    return _mm256_and_si256(_mm256_srlv_epi32(t, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, 0x10 where bit j is set (byte j), 0 elsewhere: the Q5 fifth bits, ready to OR onto
// the nibbles.  Byte j holds qh byte j / 8 masked to bit j % 8; vpsignb then turns any nonzero byte into the
// constant's byte, negated where the mask byte is negative (bit 7, 0x80), so that lane's constant is -0x10.
// 3 vector ops where or + cmpeq + and take 4.
PYLLM_INLINE __m256i high_bits_x16_32(const uint8_t* p) {
    uint32_t x32;
    memcpy(&x32, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x32)), shuf);
    const __m256i bit = _mm256_and_si256(bytes, _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull)));
    return _mm256_sign_epi8(_mm256_set1_epi64x(static_cast<long long>(0xF010101010101010ull)), bit);
}

// sum of u8 * s8 over 32 bytes -> 8 int32 partial sums.  maddubs saturates at int16, which never happens
// for our codes (unsigned <= 63 against |xq| <= 127: 2 * 63 * 127 = 16002 < 32767), so VNNI's vpdpbusd (no
// intermediate int16) gives the same sums in one instruction instead of two plus a constant.
#ifdef PYLLM_VNNI
// acc + per int32 lane the sum of its 4 products u8 * s8, exact in int32: vpdpbusd.  gemv_vnni_emulated.cpp
// (PYLLM_VNNI_EMULATED) computes the same sums with AVX2 instructions: bytes widened to int16 (u8 zero-, s8
// sign-extended), even and odd bytes apart, vpmaddwd pairs them within each lane; every product and pair sum is
// exact in int32, so the result is vpdpbusd's bit for bit.
PYLLM_INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#ifdef PYLLM_VNNI_EMULATED
    const __m256i even = _mm256_set1_epi16(0x00FF);
    const __m256i pe = _mm256_madd_epi16(_mm256_and_si256(u, even), _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8));
    const __m256i po = _mm256_madd_epi16(_mm256_srli_epi16(u, 8), _mm256_srai_epi16(s, 8));
    return _mm256_add_epi32(acc, _mm256_add_epi32(pe, po));
#else
    return _mm256_dpbusd_epi32(acc, u, s);
#endif
}
#endif

// acc + vpmaddwd(a, b): the int16 pair products summed into int32 lanes, then added with wrap-around.  Under VNNI
// one vpdpwssd, which wraps where vpaddd does (vpdpwssds would saturate), so every build has the same bits.
PYLLM_INLINE __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
#if defined(PYLLM_VNNI) && !defined(PYLLM_VNNI_EMULATED)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

PYLLM_INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef PYLLM_VNNI
    return dpbusd(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// s8 * s8: move the sign of a onto b so maddubs sees |a| (unsigned).  Exact because activations never
// hold -128 (|x * 127 / max|x|| <= 127 after rounding), so negating b cannot wrap: 2 * 128 * 127 < 32767.
PYLLM_INLINE __m256i dot_s8s8(__m256i a, __m256i b) {
    return dot_u8s8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

// 32 int8 codes -> 32 floats y[j] = a_j * float(q_j) - b_j with (a, b) = (a0, b0) for j < 16, (a1, b1) after.
// Multiply and subtract stay separate roundings (no FMA) to match gguf.quants.dequantize bit for bit.
template <bool Sub>
PYLLM_INLINE void store32(__m256i q, float a0, float a1, float b0, float b1, float* y) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int p = 0; p < 4; ++p) {
        const __m256 a = _mm256_set1_ps(p < 2 ? a0 : a1);
        __m256 v = _mm256_mul_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[p])));
        if (Sub) v = _mm256_sub_ps(v, _mm256_set1_ps(p < 2 ? b0 : b1));
        _mm256_storeu_ps(y + 8 * p, v);
    }
}

}  // namespace PYLLM_SIMD_NS
}  // namespace cpu
}  // namespace pyllm
#endif
