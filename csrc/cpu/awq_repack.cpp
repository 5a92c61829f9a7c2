// AutoAWQ "gemm" tensors -> pyllm's AWQ rows (blocks.h AwqRow), once per weight at load.
//
// AutoAWQ stores W^T: qweight int32 [K, N/8], word c of row k holding columns 8c + AWQ_ORDER[i] in nibble i;
// qzeros int32 [K/G, N/8] the same way; scales fp16 [K/G, N].  The kernels want W: one row per output n with
// its K codes in the Q4_0 element order.  So this is a 4-bit transpose.  Work goes by strips of word columns
// (CW words = 8 CW output rows) and 32-row k blocks: the strip's 32 input lines (32 x 64 bytes) and its 8 CW
// output rows (16 bytes each per k block) all stay in L1, and the strips run in parallel.  The AVX2 version
// (picked with the kernels' ISA, so set_isa('scalar') tests the scalar one) gathers and byte-transposes.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "avx2_util.h"
#include "cpu_impl.h"

namespace pyllm {
namespace {

// Codes of k block kb (32 rows of qweight) for word column c -> the 16 code bytes of each of its 8 output rows.
// Element j of a block goes to the low nibble of byte j (j < 16), element j + 16 to the high nibble of byte j.
void repack_block_scalar(const int32_t* qweight, int N8, int kb, int c, uint8_t* const dst[8]) {
    uint32_t wv[QK];
    for (int j = 0; j < QK; ++j) wv[j] = static_cast<uint32_t>(qweight[static_cast<size_t>(QK * kb + j) * N8 + c]);
    for (int i = 0; i < 8; ++i)
        for (int j = 0; j < QK / 2; ++j)
            dst[i][j] = static_cast<uint8_t>(((wv[j] >> (4 * i)) & 15) | (((wv[j + 16] >> (4 * i)) & 15) << 4));
}

#ifdef PYLLM_AVX2
// The same with a byte transpose: gather the 32 words, regroup their bytes so byte b of words 0..15 (L_b) and
// of words 16..31 (H_b) are 16 contiguous bytes each, then nibble 2b of the output is L_b & 15 | (H_b & 15) << 4
// and nibble 2b + 1 is L_b >> 4 | (H_b & 0xF0).
void repack_block_avx2(const int32_t* qweight, int N8, int kb, int c, uint8_t* const dst[8]) {
    const int32_t* base = qweight + static_cast<size_t>(QK * kb) * N8 + c;
    const __m256i vidx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(N8));
    // per 128-bit lane (4 words): bytes ordered [byte 0 of the 4 words, byte 1 ..., byte 2 ..., byte 3 ...]
    const __m256i bsh = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                         0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i dperm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // -> qword b = byte b of 8 words
    __m256i g[4];
    for (int q = 0; q < 4; ++q) {
        const __m256i w = _mm256_i32gather_epi32(reinterpret_cast<const int*>(base + static_cast<size_t>(8 * q) * N8),
                                                 vidx, 4);
        g[q] = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(w, bsh), dperm);
    }
    // lo: [L0 | L2], [L1 | L3]; hi: [H0 | H2], [H1 | H3]
    const __m256i l02 = _mm256_unpacklo_epi64(g[0], g[1]), l13 = _mm256_unpackhi_epi64(g[0], g[1]);
    const __m256i h02 = _mm256_unpacklo_epi64(g[2], g[3]), h13 = _mm256_unpackhi_epi64(g[2], g[3]);
    const __m256i m = _mm256_set1_epi8(0x0F), mh = _mm256_set1_epi8(static_cast<char>(0xF0));
    const __m256i e02 = _mm256_or_si256(_mm256_and_si256(l02, m), _mm256_slli_epi16(_mm256_and_si256(h02, m), 4));
    const __m256i o02 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l02, 4), m), _mm256_and_si256(h02, mh));
    const __m256i e13 = _mm256_or_si256(_mm256_and_si256(l13, m), _mm256_slli_epi16(_mm256_and_si256(h13, m), 4));
    const __m256i o13 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l13, 4), m), _mm256_and_si256(h13, mh));
    // nibbles 0, 4 | 1, 5 | 2, 6 | 3, 7
    const __m256i v[4] = {e02, o02, e13, o13};
    for (int p = 0; p < 4; ++p) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst[p]), _mm256_castsi256_si128(v[p]));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst[p + 4]), _mm256_extracti128_si256(v[p], 1));
    }
}
#endif

}  // namespace

void awq_repack_cpu(const int32_t* qweight, const int32_t* qzeros, const uint16_t* scales, int K, int N, int G,
                    uint8_t* out) {
    const int N8 = N / 8, ng = K / G, nkb = K / QK;
    const size_t rb = 3 * static_cast<size_t>(ng) + static_cast<size_t>(K) / 2;  // = qtype_row_bytes
    constexpr int CW = 16;  // one 64-byte line of qweight per k row
    const int strips = (N8 + CW - 1) / CW;
    const int nt = std::max(1, std::min(cpu_get_num_threads(), strips));
#ifdef PYLLM_AVX2
    const auto block = cpu_isa_simd(cpu_get_isa()) ? repack_block_avx2 : repack_block_scalar;
#else
    const auto block = repack_block_scalar;
#endif
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int st = 0; st < strips; ++st) {
        const int c0 = st * CW, c1 = std::min(N8, c0 + CW);
        for (int kb = 0; kb < nkb; ++kb)
            for (int c = c0; c < c1; ++c) {
                uint8_t* dst[8];
                for (int i = 0; i < 8; ++i)
                    dst[i] = out + static_cast<size_t>(8 * c + AWQ_ORDER[i]) * rb + 3 * ng + QK / 2 * kb;
                block(qweight, N8, kb, c, dst);
            }
        for (int c = c0; c < c1; ++c)
            for (int i = 0; i < 8; ++i) {
                const int n = 8 * c + AWQ_ORDER[i];
                uint8_t* s = out + static_cast<size_t>(n) * rb;  // row: s [ng] fp16 | z [ng] | qs [K/2]
                uint8_t* z = s + 2 * ng;
                for (int g = 0; g < ng; ++g) {
                    memcpy(s + 2 * g, scales + static_cast<size_t>(g) * N + n, 2);
                    z[g] = static_cast<uint8_t>((static_cast<uint32_t>(qzeros[static_cast<size_t>(g) * N8 + c]) >> (4 * i)) & 15);
                }
            }
    }
}

}  // namespace pyllm
